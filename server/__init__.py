"""`foldline serve`: an OpenAI-compatible HTTP server over the runtime's batched rows (the `serve` extra)."""
