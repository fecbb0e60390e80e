"""`tierfs coldstart`: a model's cold start measured as a chain of stages.

A model is not ready when its first file opens: the loader discovers the
checkpoint (listing, index and config JSON, safetensors headers), reads the
weight bytes, materializes tensors in host memory and copies them to the
device. Each stage has its own time and its own bottleneck, and which one
dominates changes with format, tier and host, so each is timed on its own,
with the bytes it moved and where they came from (page cache, tier 1, store).

model.py finds the weights (stdlib only); stages.py runs the chain (PyTorch,
imported only when a load runs); tiers.py says where bytes came from;
report.py prints the table, JSON and chart; command.py is the CLI.
"""
