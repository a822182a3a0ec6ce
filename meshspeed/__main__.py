import os

if "RANK" not in os.environ:  # not a torchrun rank: this process plans and launches the workers
    # numpy's OpenBLAS starts a thread pool as it loads, and only a single-threaded launcher may
    # fork its CPU workers (comm.launch.start_method). Forked workers keep one BLAS thread.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from meshspeed.cli import main  # noqa: E402 - after the environment it reads at import

raise SystemExit(main())
