"""The planning layer: pure Python, no torch, TRL or transformers imports (a test walks this folder)."""
