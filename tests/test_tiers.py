"""tests/tiers.py names real tests, and each names the CI test that keeps its claim.

conftest refuses a stale entry only when the entry's file is collected whole; this checks every
entry statically, so a renamed test fails here even in a run that collects one file."""

from __future__ import annotations

import os
import re

from tests.tiers import _ENTRIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_slow_entry_names_a_test_that_exists_once():
    keys = [k for k, _ in _ENTRIES]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    missing = []
    for key in keys:
        path, name = key.split("::")
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        if not re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, re.M):
            missing.append(key)
    assert missing == [], missing


def test_every_slow_entry_names_the_ci_test_that_keeps_its_claim():
    # a sibling is named as a test function, a parameter case, or a test file
    vague = [k for k, why in _ENTRIES if not re.search(r"test_\w+|\[[\w:-]+\]", why)]
    assert vague == [], vague
