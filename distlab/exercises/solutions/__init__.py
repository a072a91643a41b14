"""Reference solutions: each the text of a ``%%ddp`` cell that defines what its exercise asks for."""
