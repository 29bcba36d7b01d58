"""`tokenmill tables maintain`: what outlives a job is deleted once nothing reads it again: dead budget
reservations, and the Pushgateway groups of jobs finished long enough ago to have been scraped."""

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from pipeline.job.maintain import maintain
from pipeline.stores.catalog import StateStore
from pipeline.stores.units import Reservation, UnitQueue


class Gateway(BaseHTTPRequestHandler):
    """A Pushgateway's group listing and DELETE, over `groups` (each a dict of its grouping labels)."""

    groups: list[dict] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        # As the Pushgateway lists a group: its grouping labels, then each metric family with its series.
        data = [
            {"labels": g}
            | (
                {"tokenmill_job_info": {"type": "GAUGE", "metrics": [{"labels": {"job_id": g["pipeline"][4:]}}]}}
                if "pipeline" in g
                else {}
            )
            for g in Gateway.groups
        ]
        body = json.dumps({"status": "success", "data": data}).encode()
        self.send_response(200 if self.path == "/api/v1/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_DELETE(self):  # noqa: N802
        parts = unquote(self.path).split("/")[2:]  # /metrics/job/<job>/<label>/<value>...
        labels = dict(zip(parts[::2], parts[1::2]))
        Gateway.groups = [g for g in Gateway.groups if g != labels]
        self.send_response(202)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_maintain_deletes_dead_reservations_and_the_groups_of_jobs_finished_past_the_grace(make_config):
    """Reservation rows of claims taken over and Pushgateway groups were never deleted: the catalog grew with
    every dead worker, and the gateway served finished jobs' last values for good (a cap at 0 kept an alert
    firing). `tables maintain` deletes both, keeping groups of running jobs, of jobs finished within the
    grace, of jobs the catalog does not know, and of other job labels."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = make_config(metrics__pushgateway_url=f"http://127.0.0.1:{server.server_port}", metrics__job_label="tm")
    state, queue = StateStore(config.state.url), UnitQueue(StateStore(config.state.url))
    for job, status, ago in (("old", "succeeded", 3600), ("fresh", "cancelled", 60), ("live", "running", None)):
        assert state.claim_planning(job, "fp", "in", "out")
        finished = None if ago is None else state.db_now() - timedelta(seconds=ago)
        state.set_job(job, status=status, finished_at=finished)
    group = lambda job, instance, label="tm": {"job": label, "job_id": job, "instance": instance}  # noqa: E731
    # A pipeline's one group names its job in its `tokenmill_job_info` series (here: the pipeline `for-<job>`).
    pipeline = lambda job, label="tm": {"job": label, "pipeline": f"for-{job}"}  # noqa: E731
    kept = [group("fresh", "h:3"), group("live", "h:4"), group("elsewhere", "h:5"), group("old", "h:6", "other")]
    kept += [pipeline("fresh"), pipeline("live"), pipeline("elsewhere"), pipeline("old", "other")]
    Gateway.groups = [group("old", "h:1"), group("old", "h:2"), pipeline("old"), *kept]
    queue.enqueue("old", "p", 0, {"small": ["k"]})
    unit = queue.claim("old", "small", "w", "s", lease_seconds=60)
    with state.db_session() as s, s.begin():  # a reservation an older version left when its claim was taken over
        s.add(Reservation(job_id="old", unit_id=unit.unit_id, epoch=unit.epoch - 1, item_key="k", tenant="t", usd=1.0))
    assert queue.reserve("old", unit, [("k", "t", 0.5)], {"small": 1.0}, lambda planned: []) == []
    try:
        gone = maintain(config, grace_seconds=600)
    finally:
        server.shutdown()
        server.server_close()
    assert gone == {"reservations": 1, "groups": 3}
    assert Gateway.groups == kept
    with state.db_session() as s:
        assert [(r.epoch, r.usd) for r in s.query(Reservation).all()] == [(unit.epoch, 0.5)], "the live one stays"
