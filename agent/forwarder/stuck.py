"""A topic that cannot deliver: since when, on which error, how many failed sends.

The forwarder keeps one per topic whose sends fail with an error it retries (agent/forwarder/
failures.py) and drops it at the topic's next acknowledgement. The status documents show it
on the topic's row, and health names the topic and the error (CRITICAL when only an operator
can fix it, such as an ACL).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Stuck:
    error: str  # the Kafka error's name, e.g. TOPIC_AUTHORIZATION_FAILED
    cluster: str
    detail: str
    operator: bool
    since: float = field(default_factory=time.time)  # wall clock: shown to people
    last: float = field(default_factory=time.time)
    failures: int = 1

    def again(self, error: str, cluster: str, detail: str, operator: bool) -> None:
        self.error, self.cluster, self.detail, self.operator = error, cluster, detail, operator
        self.last = time.time()
        self.failures += 1

    def to_json(self) -> dict[str, object]:
        return {"error": self.error, "cluster": self.cluster, "detail": self.detail,
                "operator": self.operator, "since": self.since, "last_time": self.last,
                "failures": self.failures}
