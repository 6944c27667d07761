"""Distilling a draft model from its target for speculative decoding (``meshserve distill``)."""
