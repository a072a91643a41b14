"""The processes a lab runs on: how engines start, which processes are ours, and making sure none outlives the lab."""
