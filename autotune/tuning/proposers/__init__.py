"""Proposers: where the next trial configuration comes from."""
