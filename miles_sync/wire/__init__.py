"""The SGLang wire contract: request/response records, the codec, the flattened bucket layout,
the tensor payload codec, the draft report and the engine API every engine kind speaks. Imports nothing above it."""
