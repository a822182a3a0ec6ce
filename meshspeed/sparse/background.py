"""Mask updates off the critical path: a snapshot of every target, a worker that runs the
controller on it, and a result applied at a step fixed by the caller (never by timing).

    snaps = [Snapshot.of(name, t) for name, t in targets]        # copies: training goes on
    job = MaskJob(lambda: controller.update_on(step, snaps))      # a thread (+ side stream on CUDA)
    ... the next training step runs ...
    record = job.result()                                         # joins; then install snaps' masks

The controller reads only a target's surface (name, weight[.grad], mask, nm, transposable,
groups, sr_ste_lambda, set_mask), so a Snapshot can stand in for a SparseLinear, a SparseParam
or a tensor-parallel full view: the computation is the very one a synchronous update runs, on
the same values, hence the same masks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class Snapshot:
    """A target frozen at one step: its weight (and gradient) copied, its mask as it was; set_mask
    and the sr_ste_lambda setter only record, the caller installs them later."""

    def __init__(self, name: str, weight: torch.Tensor, grad: torch.Tensor | None, target) -> None:
        self.name = name
        self.weight = weight
        self.weight.grad = grad
        self.mask = target.mask.detach().clone()
        self.nm, self.transposable, self.groups = target.nm, target.transposable, target.groups
        self.sr_ste_lambda = float(target.sr_ste_lambda)

    @classmethod
    def of(cls, name: str, target, *, need_grad: bool) -> Snapshot:
        """Copy `target`'s weight (fp32) and, when `need_grad`, its gradient (main_grad for bf16
        parameters): the live tensors change under the next step (zero_grad, optimizer)."""
        w = target.weight
        weight = w.detach().float().clone()
        grad = None
        if need_grad:
            g = getattr(w, "main_grad", None)
            g = g if g is not None else w.grad
            grad = None if g is None else g.detach().float().clone()
        return cls(name, weight, grad, target)

    def set_mask(self, mask: torch.Tensor, *, check: bool = True) -> None:
        self.mask = mask.to(torch.bool)


class MaskJob:
    """Runs `fn` in a worker thread; `result()` joins and returns its value (or raises its error).

    On CUDA the work runs on a side stream that first waits for the snapshot copies queued on the
    current stream, and `result()` makes the current stream wait for the side stream, so masks are
    complete before any kernel of the step that installs them reads them. With `threaded=False`
    `fn` runs inline at construction (the same result, for tests and for debugging)."""

    def __init__(self, fn: Callable[[], object], *, device: torch.device, threaded: bool = True) -> None:
        self._value: object = None
        self._error: BaseException | None = None
        self._stream = self._ready = self._done = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._ready = torch.cuda.current_stream(device).record_event()
            self._done = torch.cuda.Event()
        if not threaded:
            self._run(fn)
            self._thread = None
            return
        self._thread = threading.Thread(target=self._run, args=(fn,), name="meshspeed-masks", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            if self._stream is None:
                self._value = fn()
                return
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._ready)
                self._value = fn()
                self._done.record(self._stream)
        except BaseException as err:  # noqa: BLE001 - re-raised on the training thread in result()
            self._error = err

    def result(self) -> object:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        if self._done is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._done)
        return self._value
