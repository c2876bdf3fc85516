"""The suite's stored fixtures hold on any date: a synthetic profile made on another day has
the digest the stored schedule records, so `check_schedule` accepts it."""

import subprocess
import sys

from repo import ROOT
from search_fixtures import small_profile

# Run in a fresh interpreter whose clock reads another day: `date.today()` and
# `datetime.now()` are replaced before nanosched is imported, so every module that reads the
# clock (at import or at call) sees the moved date.
MOVED_CLOCK = r"""
import datetime, sys
class D(datetime.date):
    @classmethod
    def today(cls):
        return cls(2031, 7, 19)
class DT(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2031, 7, 19, 12, 0, 0, tzinfo=tz)
    @classmethod
    def today(cls):
        return cls(2031, 7, 19, 12, 0, 0)
datetime.date, datetime.datetime = D, DT
sys.path[:0] = [sys.argv[1]]
assert datetime.date.today().year == 2031
from search_fixtures import small_profile, small_schedule
from nanosched.autosearch.check import check_schedule
prof = small_profile()
check_schedule(small_schedule(), prof)
print(prof.digest())
"""


def test_fixtures_hold_on_another_date():
    out = subprocess.run([sys.executable, "-c", MOVED_CLOCK, str(ROOT / "tests" / "helpers")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == small_profile().digest()
