"""Export parity: runs a tiny Megatron model under TP/PP/EP and compares against transformers."""
