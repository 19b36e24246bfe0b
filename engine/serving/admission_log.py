"""What admission by deadline refused, said in the log, at most once per period.

A caller refused with Overloaded gets a 503; its operator needs to tell
those refusals from an engine that is simply full, and to see whether the
predictions that refused them were any good. Each period the supervisor
asks (tick); when admission refused requests since the last line, one line
says how many, and how its predictions compared with the waits seen, over
the same period.
"""
import logging

from engine.shm import codes

log = logging.getLogger("shmbatch")

PERIOD_NS = 10_000_000_000  # at most one line per engine per 10 s


class AdmissionLog:
    def __init__(self, name: str, ring, now_ns: int):
        self.name, self.ring = name, ring
        self.next_ns = now_ns + PERIOD_NS
        self.seen = self._figures()

    def _figures(self):
        w = self.ring.word
        return (w(codes.W_OVERLOADED), w(codes.W_REQUESTS), w(codes.W_ADMIT_COMPARED),
                w(codes.W_ADMIT_PREDICTED_NS), w(codes.W_ADMIT_SEEN_NS), w(codes.W_ADMIT_LATE))

    def tick(self, now_ns: int):
        """Logs the period's refusals, once it has ended; returns the line or None."""
        if now_ns < self.next_ns:
            return None
        figures = self._figures()
        refused, queued, compared, predicted_ns, seen_ns, late = (
            now - then for now, then in zip(figures, self.seen))
        self.seen, self.next_ns = figures, now_ns + PERIOD_NS
        if refused <= 0:
            return None
        line = (f"engine {self.name}: admission refused {refused} of {refused + queued} requests "
                f"in the last {PERIOD_NS // 1_000_000_000} s (Overloaded, 503: the predicted wait "
                f"ended after the request's deadline)")
        scale = (self.ring.word(codes.W_ADMIT_SCALE) or codes.SCALE_ONE) / codes.SCALE_ONE
        if compared > 0:
            line += (f"; of {compared} admitted on a counted prediction, the waits predicted "
                     f"{predicted_ns / compared / 1e6:.1f} ms and seen {seen_ns / compared / 1e6:.1f}"
                     f" ms on average, {100 * late / compared:.0f} % longer than predicted")
        line += f"; predictions are corrected x{scale:.2f} by the waits seen"
        log.warning("%s", line, extra={"engine": self.name})  # a JSON log's engine field
        return line
