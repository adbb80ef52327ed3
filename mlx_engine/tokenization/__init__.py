"""Text to token ids and back: tokenizers, chat templates, stop strings."""
