"""Finding, checking and loading models: HF ids, local MLX folders, GGUF files."""
