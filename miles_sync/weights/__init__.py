"""Pure functions over weight tensors: physical layouts an engine applies, and bitwise checksums."""
