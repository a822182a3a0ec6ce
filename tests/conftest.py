"""Session-wide test settings."""

import torch

# The distributed tests keep pools of worker processes on the same two cores; a multi-threaded
# main process would fight them for the CPU and slow every test down.
torch.set_num_threads(1)
