"""The OpenAI-compatible HTTP server (`duet serve`)."""
