"""``lmforge serve``: an OpenAI-compatible HTTP API over a trained checkpoint."""
