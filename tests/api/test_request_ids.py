"""Gateway request ids (gateway/api/reply.py::new_request_id): the key of budgets, the spend ledger, routing's
in-flight table and the audit record."""
from __future__ import annotations

import os
import random
import re
import time

from gateway.api.reply import new_request_id

_SHAPE = re.compile(r"^req_[0-9a-f]{24}$")


def test_ids_keep_their_shape_and_are_unique():
    ids = [new_request_id() for _ in range(50_000)]
    assert all(_SHAPE.match(i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_ids_are_ordered_by_the_millisecond_they_were_made_in():
    """Time-ordered: an index keyed by them appends at its right edge (bench/ledger_ids.py measures why)."""
    a = new_request_id()
    time.sleep(0.003)
    b = new_request_id()
    assert a < b
    ms = int(a[4:16], 16)
    assert abs(ms - time.time() * 1000) < 60_000


def test_ids_do_not_follow_the_global_random_seed():
    """A caller seeding `random` (tests, libraries) must not make two processes or runs draw the same ids."""
    random.seed(1)
    a = new_request_id()
    random.seed(1)
    b = new_request_id()
    assert a[16:] != b[16:]


def test_a_forked_child_draws_its_own_ids():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out
        os.close(r)
        os.write(w, "".join(new_request_id()[16:] for _ in range(4)).encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 1000).decode()
    os.close(r)
    os.waitpid(pid, 0)
    mine = "".join(new_request_id()[16:] for _ in range(4))
    assert len(child) == 48 and child != mine
