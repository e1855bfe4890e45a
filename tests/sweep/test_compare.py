"""The runs a sweep's fit uses (each cell at its best LR, all its seeds) and the equal-tokens
table (megatron_iiet.sweep.compare), on hand-made results whose answer is known."""

import pytest

from megatron_iiet.sweep.compare import best_lr_rows, equal_tokens_table


def run(arch, size, tokens, lr, seed, loss, wikitext=None, params=1e5):
    return {"architecture": arch, "size": size, "params": params, "tokens": tokens, "lr": lr,
            "seed": seed, "loss": loss, "valid_loss": loss, "valid_loss_wikitext": wikitext,
            "flops": 6 * params * tokens}


LADDER = [
    # xs, 1e6 tokens: vanilla's grid; 2e-3 wins on the mean of three seeds although 1e-3 has the
    # single lowest run
    run("vanilla", "xs", 1e6, 1e-3, 1234, 5.0, 6.0),
    run("vanilla", "xs", 1e6, 2e-3, 1234, 5.1, 6.1),
    run("vanilla", "xs", 1e6, 2e-3, 1, 4.9, 5.9),
    run("vanilla", "xs", 1e6, 2e-3, 2, 4.8, 5.8),
    run("vanilla", "xs", 3e6, 1e-3, 1234, 4.5, 5.5),
    run("vanilla", "xs", 3e6, 2e-3, 1234, 4.6, 5.6),
    run("iiet", "xs", 1e6, 1e-3, 1234, 5.3, 6.2, params=1.01e5),
    run("vanilla", "s", 1e6, 6.7e-4, 1234, 4.7, 5.7, params=3e5),
    run("iiet", "s", 1e6, 6.7e-4, 1234, 4.6, 5.6, params=3e5),
]


def test_each_cell_keeps_every_seed_of_its_best_lr():
    kept = best_lr_rows(LADDER)
    cells = {(r["architecture"], r["size"], r["tokens"], r["lr"], r["seed"]) for r in kept}
    assert cells == {("vanilla", "xs", 1e6, 2e-3, 1234), ("vanilla", "xs", 1e6, 2e-3, 1),
                     ("vanilla", "xs", 1e6, 2e-3, 2), ("vanilla", "xs", 3e6, 1e-3, 1234),
                     ("iiet", "xs", 1e6, 1e-3, 1234), ("vanilla", "s", 1e6, 6.7e-4, 1234),
                     ("iiet", "s", 1e6, 6.7e-4, 1234)}
    synthetic = [{"architecture": "a", "params": 1e5, "tokens": 1e6, "flops": 6e11, "loss": 3.0}]
    assert best_lr_rows(synthetic) == synthetic  # no LR: nothing to choose


def test_equal_tokens_table_shows_the_seed_mean_and_spread():
    table = equal_tokens_table(LADDER, {"valid": "valid_loss", "wikitext": "valid_loss_wikitext"})
    lines = table.splitlines()
    assert lines[0] == ("| size | non-emb params | tokens | vanilla (valid) | iiet (valid) | "
                        "vanilla (wikitext) | iiet (wikitext) | FLOPs vanilla | FLOPs iiet |")
    xs_1m = next(line for line in lines if line.startswith("| xs | 0.100M | 1M |"))
    cells = [c.strip() for c in xs_1m.strip("|").split("|")]
    assert cells[3] == "4.933 ± 0.153 (n=3)" and cells[4] == "5.300"
    assert cells[5] == "5.933 ± 0.153 (n=3)" and cells[6] == "6.200"
    assert cells[7] == "6e+11" and cells[8] == "6.06e+11"
    xs_3m = next(line for line in lines if line.startswith("| xs | 0.100M | 3M |"))
    assert [c.strip() for c in xs_3m.strip("|").split("|")][3:5] == ["4.500", ""]
    assert lines.index(xs_3m) < next(i for i, line in enumerate(lines) if line.startswith("| s |"))
