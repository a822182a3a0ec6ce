"""Verified checkpoints: save/load through DCP with resharding (dcp), run and step directories
(dirs), the tensor mapping of a rank's state (tensors), the checksummed manifest, safetensors
files and the full-model export. Imports only comm/ (and sparse/ for masked export)."""
