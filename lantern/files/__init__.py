"""File handling: atomic writes, the user cache, image files, checked JSON reading and hashing."""
