"""The per-sample error budget: ``DataLoader(sample_errors="skip" | "warn", max_sample_errors=)``.

With ``"raise"`` (the default) a sample whose fetch or decode fails fails its batch, as in
torch. With ``"skip"`` or ``"warn"`` the worker leaves that sample out of its batch (the batch
is smaller, never refilled: refilling would change which samples later batches hold, and a
resumed pass could not reproduce it) and reports a ``SkippedSample`` with the batch. The main
process counts them here, warns (``"warn"``: one ``AsyncloadWarning`` per skipped sample) and
fails the pass with ``SampleErrorBudgetExceeded`` once the budget is spent.

Resume stays exact: a skipped sample belongs to a batch that was delivered, so it is not fetched
again after ``load_state_dict``. The count restarts with every pass (and after a resume).
"""

from __future__ import annotations

import collections
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from .._exceptions import AsyncloadWarning, SampleErrorBudgetExceeded
from .._redact import redact_url

__all__ = ["Budget", "SampleErrorPolicy", "SkippedSample", "policy"]

Mode = Literal["raise", "skip", "warn"]

_SHOWN = 5  # failures listed in SampleErrorBudgetExceeded's message


@dataclass(frozen=True, slots=True)
class SampleErrorPolicy:
    """``sample_errors`` and ``max_sample_errors``, validated."""

    mode: Mode = "raise"
    limit: int | float | None = None
    """A count of skipped samples, a fraction of the samples seen in the pass, or no limit."""

    @property
    def skips(self) -> bool:
        return self.mode != "raise"


def policy(sample_errors: Any, max_sample_errors: Any) -> SampleErrorPolicy:
    """Check the two DataLoader arguments; raise ``ValueError`` naming the bad one."""
    if sample_errors not in ("raise", "skip", "warn"):
        raise ValueError(
            f"sample_errors must be 'raise', 'skip' or 'warn' (as TarShards' handler=), "
            f"got {sample_errors!r}"
        )
    limit = max_sample_errors
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int | float):
            raise ValueError(
                "max_sample_errors must be an int (a count), a float in (0, 1) (a fraction of "
                f"the samples seen) or None (no limit), got {limit!r}"
            )
        if isinstance(limit, int) and limit < 0:
            raise ValueError(f"max_sample_errors must be >= 0, got {limit!r}")
        if isinstance(limit, float) and not 0.0 < limit < 1.0:
            raise ValueError(
                f"a fractional max_sample_errors must lie in (0, 1), got {limit!r}; pass an "
                "int for a count"
            )
        if sample_errors == "raise":
            raise ValueError("max_sample_errors needs sample_errors='skip' or 'warn'")
    return SampleErrorPolicy(sample_errors, limit)


@dataclass(frozen=True, slots=True)
class SkippedSample:
    """One sample a worker left out of its batch: plain values, cheap to pickle."""

    index: Any
    """The sample's index (map-style), or its position in the worker's stream (iterable)."""
    url: str | None
    """The URL the error names (``LoadError.url``), credentials redacted."""
    error_type: str
    message: str

    @classmethod
    def capture(cls, exc: BaseException, index: Any) -> SkippedSample:
        url = getattr(exc, "url", None)
        return cls(
            index=index,
            url=redact_url(url) if isinstance(url, str) else None,
            error_type=type(exc).__name__,
            message=redact_url(str(exc))[:300],
        )

    def describe(self) -> str:
        named = self.url and self.url not in self.message
        where = f"sample {self.index!r}" + (f" ({self.url})" if named else "")
        return f"{where}: {self.error_type}: {self.message}"


class Budget:
    """The main process's count of skipped samples for one pass."""

    def __init__(self, policy: SampleErrorPolicy) -> None:
        self.policy = policy
        self.seen = 0
        self.skipped: collections.Counter[str] = collections.Counter()
        self.first: list[SkippedSample] = []

    @property
    def total(self) -> int:
        return sum(self.skipped.values())

    def add(self, delivered: int, skipped: tuple[SkippedSample, ...]) -> None:
        """Account for one batch: *delivered* samples in it, *skipped* left out.

        Raises:
            SampleErrorBudgetExceeded: More samples were skipped than ``max_sample_errors``.
        """
        self.seen += delivered + len(skipped)
        for s in skipped:
            self.skipped[s.error_type] += 1
            if len(self.first) < _SHOWN:
                self.first.append(s)
            if self.policy.mode == "warn":
                warnings.warn(
                    f"asyncload: skipped {s.describe()} (sample_errors='warn')",
                    AsyncloadWarning,
                    stacklevel=4,
                )
        if skipped and self._exceeded():
            raise SampleErrorBudgetExceeded(self._message())

    def _allowed(self) -> float:
        limit = self.policy.limit
        if limit is None:
            return math.inf
        if isinstance(limit, float):
            # At least one error is tolerated, so a 1% budget does not fail on the first
            # sample of a pass.
            return max(1.0, limit * self.seen)
        return limit

    def _exceeded(self) -> bool:
        return self.total > self._allowed()

    def _message(self) -> str:
        limit = self.policy.limit
        budget = (
            f"max_sample_errors={limit} ({limit:.2%} of {self.seen} samples seen)"
            if isinstance(limit, float)
            else f"max_sample_errors={limit}"
        )
        lines = "\n".join(f"  - {s.describe()}" for s in self.first)
        return (
            f"{self.total} samples failed in this pass, more than {budget}; the first "
            f"{len(self.first)}:\n{lines}\nFix the data, or raise max_sample_errors."
        )
