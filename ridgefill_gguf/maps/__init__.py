"""The maps GGUF: format (the contract with the engine), quantization, conversion and inspection."""
