"""hapnb.teach: answers graded by the theory. A correct answer is optimal with a proof chain, a valid but
slower one carries its cost gap and a hint that re-planning confirms, an invalid one names the op and the
tensors of the failing triple; bad input is an error that says what to write instead."""

from __future__ import annotations

import dataclasses

import pytest

from hapnb import teach
from hapnb.teach import AnswerError, Exercise


def _chain_holds(plan) -> bool:
    """Every instruction's precondition was established by an instruction before it (a proof chain)."""
    made: set[tuple[str, str]] = set()
    for ins in plan.program:
        if ins.kind == "load":
            pre, post = [], [(ins.tensor, ins.form)]
        elif ins.kind == "collective":
            pre, post = [(ins.tensor, ins.src)], [(ins.tensor, ins.form)]
        else:
            pre, post = list(ins.inputs), list(ins.outputs)
        if not all(p in made for p in pre):
            return False
        made.update(post)
    return any(f == "R" for _, f in made)


@pytest.mark.parametrize("key", [ex.key for ex in teach.EXERCISES])
def test_every_solution_is_optimal_with_a_proof(key: str) -> None:
    ex = teach.exercise(key)
    sol = ex.solution()
    assert sol.status == "optimal" and sol.gap_s == pytest.approx(0.0, abs=1e-12)
    assert {t for t, _ in sol.answer} == set(ex.asks)
    assert sol.proof and sol.proof[-1].endswith(":R}") and _chain_holds(sol.plan)
    assert ex.lesson in sol.notes


def test_shard_linear_three_answers() -> None:
    ex = teach.exercise("shard-linear")
    # correct: the weight split by output features, the batch whole
    right = ex.check({"x": "I", "layers.0.weight": "G0"})
    assert right.status == "optimal" and right.cost_s == pytest.approx(right.optimum_s)
    # valid but slower: data parallelism pays for the weight's gradient (or its SFB factors)
    slow = ex.check({"x": "G0", "layers.0.weight": "I"})
    assert slow.status == "valid" and slow.gap_s > 0 and slow.gap > 0
    assert slow.cost_s == pytest.approx(slow.optimum_s + slow.gap_s)
    assert slow.collectives and any("x" in c for c in slow.collectives)
    assert "saves" in slow.hint and _chain_holds(slow.plan)
    # invalid: no triple of linear takes row-sharded x and row-sharded W
    bad = ex.check({"x": "G0", "layers.0.weight": "G0"})
    assert bad.status == "invalid" and not bad.valid and bad.cost_s is None and bad.plan is None
    f = bad.failure
    assert f.op == "linear" and f.target == "aten.linear.default"
    assert "x:G0" in f.asked and "layers.0.weight:G0" in f.asked and "layers.0.weight" in f.reason
    assert f.nearest and set(f.nearest) <= set(ex.triples("linear"))
    assert f.nearest[0] in bad.hint and "INVALID" in bad.summary()


def test_megatron_mlp_gap_and_hint_follow_the_replan() -> None:
    ex = teach.exercise("megatron-mlp")
    assert ex.check({"layers.0.weight": "G0", "relu": "G1", "head.weight": "G1"}).status == "optimal"
    slow = ex.check({"layers.0.weight": "G0", "relu": "G0", "head.weight": "G1"})
    assert slow.status == "valid" and slow.gap_s > 0
    assert any(c.startswith("all_to_all") for c in slow.collectives)  # G1 -> G0 and back: implied collectives
    assert slow.hint.startswith("give relu the form G1")
    better = ex.check({"layers.0.weight": "G0", "relu": "G1", "head.weight": "G1"})
    assert f"saves {teach._ms(slow.cost_s - better.cost_s)}" in slow.hint


def test_a_form_the_tensor_cannot_take_and_a_contradicted_given() -> None:
    ex = teach.exercise("uneven-ratios")
    r = ex.check({"layers.0.weight": "R"}, ratios=[1, 1, 1])
    assert r.status == "invalid" and r.failure.op == ""
    assert "can take only I, G0, G1" in r.failure.reason
    given = ex.check({"layers.0.weight": "I", "x": "I"}, ratios=[1, 1, 1])
    assert given.status == "invalid" and "fixes x = G0" in given.failure.reason


def test_uneven_ratios_even_shares_lose_to_the_lp() -> None:
    ex = teach.exercise("uneven-ratios")
    even = ex.check({"layers.0.weight": "I"}, ratios={"v100-0": 1, "p100-0": 1, "p100-1": 1})
    assert even.status == "valid" and even.gap > 0.01
    assert even.hint.startswith("let the ratio LP choose the ratios")
    assert even.plan.ratios[0] == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    lp = dict(zip(ex.optimum.cluster.names, ex.optimum.ratios[0]))
    assert lp["v100-0"] > lp["p100-0"]  # the faster GPU holds more
    assert ex.check({"layers.0.weight": "I"}, ratios=lp).status == "optimal"


def test_sfb_pays_at_a_small_batch_only() -> None:
    ex = teach.exercise("sfb")
    no = ex.check({"layers.0.weight": "I"}, sfb=False)
    assert no.status == "valid" and no.gap > 1 and "allow SFB" in no.hint
    assert not any(i.name == "load_sfb" for i in no.plan.program)
    big = ex.variant(batch=1024)
    assert (
        big.options[-1] == ("batch", 1024)
        and big.check({"layers.0.weight": "I"}, sfb=False).status == "optimal"
    )


def test_the_grader_knows_no_answers_a_new_exercise_is_graded_the_same_way() -> None:
    options = (("layers", 1), ("hidden", 64), ("input", 32), ("batch", 8))
    ex = Exercise("mine", "my own", "shard the head", "mlp", options, "1xV100+1xP100", ("head.weight",))
    assert ex.check({"head.weight": ex.solution().answer[0][1]}).status == "optimal"
    assert teach.check(ex, {"head.weight": "zero3(0)"}).valid  # a ZeRO-3 storage computes with I
    assert ex.check({"head.weight": "G1", "relu": "G0"}).valid  # relu: G0 -> G1 by an all-to-all first
    bad = ex.check({"head.weight": "G1", "relu": "R"})  # but no triple of relu makes partial sums
    assert bad.status == "invalid" and bad.failure.op == "relu" and "relu" in bad.failure.reason


@pytest.mark.parametrize(
    "answer, kw, words",
    [
        ({"x": "G0", "layers.0.wieght": "I"}, {}, ["unknown tensor 'layers.0.wieght'", "did you mean"]),
        ({"x": "G(x)", "layers.0.weight": "I"}, {}, ["x: cannot read the pin", "G(d) / Gd / Shard(d)"]),
        ({"x": "G0"}, {}, ["gives no form for layers.0.weight", "ex.sheet()"]),
        ({"x": 0, "layers.0.weight": "I"}, {}, ["a form is a string"]),
        ([("x", "G0")], {}, ["an answer is a dict"]),
        ({"x": "G0", "layers.0.weight": "I"}, {"ratios": {"v100-9": 1}}, ["v100-9", "ratios={device:"]),
        ({"x": "G0", "layers.0.weight": "I"}, {"ratios": [1, -1]}, ["non-negative"]),
    ],
)  # fmt: skip
def test_bad_input_says_what_why_and_how(answer, kw, words) -> None:
    with pytest.raises(AnswerError) as err:
        teach.exercise("shard-linear").check(answer, **kw)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_exercise_lookup_and_missing_ratios() -> None:
    assert teach.exercise(1) is teach.EXERCISES[0] and len(teach.EXERCISES) >= 6
    with pytest.raises(AnswerError, match="the exercises are shard-linear"):
        teach.exercise("nope")
    with pytest.raises(AnswerError, match="from 1 to"):
        teach.exercise(99)
    with pytest.raises(AnswerError, match="asks for ratios too"):
        teach.exercise("uneven-ratios").check({"layers.0.weight": "I"})


def test_grades_and_exercises_render() -> None:
    ex = teach.exercise("shard-linear")
    slow = ex.check({"x": "G0", "layers.0.weight": "I"})
    html = slow._repr_html_()
    assert "VALID" in html and "hint" in html and "<details>" in html and "could not render" not in html
    assert "INVALID" in ex.check({"x": "G0", "layers.0.weight": "G0"})._repr_html_()
    page = ex._repr_html_()
    assert "layers.0.weight" in page and "forms it can take" in page and "could not render" not in page
    assert "x (input, shape (32, 512))" in str(ex)
    fig = slow.chart()
    assert fig is not None and fig.right and fig.right[0].__class__.__name__ == "Legend"  # legend outside
    assert dataclasses.replace(slow, plan=None).chart() is None
