"""The prefix-cache index: which executor holds which prompt prefix, from KV events."""
