"""Gated DeltaNet deferral (docs/method.md §4): everything that joins deferred rows into a GDN layer's state."""
