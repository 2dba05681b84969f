"""Building and running small Megatron models on this machine: model builder, CPU shims, forward."""
