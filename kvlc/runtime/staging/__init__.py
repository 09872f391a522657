"""Staging through bounce buffers: gather, one WRITE per chunk, scatter on the receiver before ``done``."""
