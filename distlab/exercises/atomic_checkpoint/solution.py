import os
import tempfile


def save_checkpoint(state, path):
    """Write ``state`` to ``path`` so that ``path`` only ever holds a complete checkpoint, the old one or the new."""
    folder = os.path.dirname(os.path.abspath(path))
    # Same folder, so the same filesystem: os.replace is then one atomic rename.
    fd, temp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()  # Python's buffer to the OS
            os.fsync(f.fileno())  # the OS's cache to the disk, before the name points at these bytes
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    # The rename itself is a change to the folder: fsync it, so it too survives a power loss.
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path):
    """The state saved at ``path``; a missing or broken file raises."""
    return torch.load(path, map_location="cpu", weights_only=True)
