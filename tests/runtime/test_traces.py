"""The shared-prefix and multi-turn workloads of `bench --workload`: their prompts' shapes,
seeding, and refusals that name the workload and the key."""

import pytest

from nanosched.errors import ConfigError
from nanosched.runtime.requests import make_requests


def reqs(workload, n=7, max_len=200, seed=0):
    return make_requests(workload, None, None, n, vocab_size=50, max_len=max_len, seed=seed)


def test_shared_prefix_groups_share_their_prefix_and_nothing_after():
    rs = reqs("shared-prefix:groups=3,prefix=10,unique=4,output=6")
    assert len(rs) == 7 and all(r.prompt_len == 14 and r.params.max_tokens == 6 for r in rs)
    assert rs[0].prompt_ids[:10] == rs[3].prompt_ids[:10] == rs[6].prompt_ids[:10]
    assert rs[0].prompt_ids[:10] != rs[1].prompt_ids[:10]
    assert rs[0].prompt_ids[10:] != rs[3].prompt_ids[10:]
    again = reqs("shared-prefix:groups=3,prefix=10,unique=4,output=6")
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in rs]  # seeded
    assert reqs("shared-prefix:groups=1,prefix=5,unique=0,output=1", n=2)[1].prompt_len == 5


def test_multi_turn_prompts_are_the_conversation_so_far_turn_by_turn():
    rs = reqs("multi-turn:turns=3,prompt=6,user=2,output=4", n=8)
    # three conversations (the last one's turn 2 cut by --num-prompts 8), turn 0 of each first
    assert [r.prompt_len for r in rs] == [6, 6, 6, 12, 12, 12, 18, 18]
    for c in range(2):
        t0, t1, t2 = rs[c], rs[3 + c], rs[6 + c]
        assert t1.prompt_ids[:6] == t0.prompt_ids and t2.prompt_ids[:12] == t1.prompt_ids
    assert rs[0].prompt_ids != rs[1].prompt_ids


@pytest.mark.parametrize("workload, message", [
    ("shared-prefix:groups=2,prefix=4", "missing unique, output (form: shared-prefix:groups=N,"),
    ("shared-prefix:groups=2,prefix=4,unique=1,output=1,turns=2", "'turns=2' is not one of"),
    ("shared-prefix:groups=0,prefix=4,unique=1,output=1", "groups must be positive, got 0"),
    ("shared-prefix:groups=2,prefix=4,unique=-1,output=1", "unique must be >= 0, got -1"),
    ("multi-turn:turns=two,prompt=4,user=1,output=1", "turns must be an integer, got 'two'"),
    ("multi-turn:turns=5,prompt=100,user=20,output=10",
     "prompt + (turns - 1) x (output + user) + output = 230 tokens exceeds the model's context "
     "of 200 tokens"),
])
def test_bad_settings_are_refused_naming_the_workload_and_key(workload, message):
    with pytest.raises(ConfigError, match="--workload") as err:
        reqs(workload)
    assert message in str(err.value)
