"""Choosing the next token: batched sampling and grammar constraints (JSON schema)."""
