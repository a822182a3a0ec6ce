"""`python -m tests.sleeper`: says so and sleeps, a long-running command for tests/test_warm.py."""

import time

print("sleeping", flush=True)
time.sleep(600)
