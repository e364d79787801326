"""Bench reports, sweeps and comparisons: `--sweep` against `inferd mock-server`, its HTML rendered by
headless Chromium (every plot checked by the page's own script, and a screenshot that is not blank),
`bench report` and `bench compare` on the files it wrote, the /metrics parsing of the
client-vs-server cross-check, the progress line, and one-line errors for bad input."""
import io
import json
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from inferd.bench.calibrate import spawn_mock
from inferd.bench.compare import compare_table, load_result
from inferd.bench.crosscheck import crosscheck, format_crosscheck, parse_exposition
from inferd.bench.progress import Progress, want_progress
from inferd.bench.svgplot import nice_ticks, tick_labels
from inferd.bench.sweep import auto_rates, capacity, parse_sweep
from inferd.errors import InferdError
from inferd.web.style import ROLE, theme_css

SLA = "p99_ttft_ms<5000,max_concurrent_requests<=4"  # with the mock, only the concurrency clause can fail


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "inferd", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def mock():
    proc, url = spawn_mock(40.0, 4.0, 12)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def sweep_run(mock, tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    r = bench("--base-url", mock, "--num-prompts", "6", "--input-len", "16", "--output-len", "12",
              "--sweep", "concurrency:1,2,4,8", "--sla", SLA, "--goodput", "ttft:1000", "--html", str(d / "s.html"),
              "--result-json", str(d / "s.json"), "--trace", str(d / "t.jsonl"), "--no-progress")
    return r, d


def test_sweep_finds_capacity_and_writes_everything(sweep_run):
    r, d = sweep_run
    assert r.returncode == 0, r.stderr
    assert "capacity at SLA" in r.stdout and ": c=4 (" in r.stdout
    assert "Server metrics cross-check: not available" in r.stdout  # the mock has no /metrics
    doc = json.loads((d / "s.json").read_text())
    assert doc["format"] == "inferd-bench-sweep" and doc["mode"] == "concurrency"
    assert [p["label"] for p in doc["points"]] == ["c=1", "c=2", "c=4", "c=8"]
    assert [p["sla_ok"] for p in doc["points"]] == [True, True, True, False]
    assert doc["capacity"]["label"] == "c=4" and doc["capacity"]["x"] == 4
    for p in doc["points"]:
        assert p["result"]["completed"] == 6 and p["result"]["total_output_tokens"] == 6 * 12
        assert len(p["samples"]["ttft"]) == 6
        assert p["result"]["max_concurrent_requests"] == min(6, p["value"])
    for tag in ("c1", "c2", "c4", "c8"):
        assert (d / f"t.{tag}.jsonl").is_file()
    page = (d / "s.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "").replace(doc["base_url"], "")
    assert "<script src" not in page and "<link" not in page


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _chrome(exe, tmp_path, *args):
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'chrome-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_sweep_html_renders_every_plot_in_chromium(sweep_run, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("no headless Chromium (`make test` installs Debian's chromium where apt-get works)")
    r, d = sweep_run
    assert r.returncode == 0, r.stderr
    html = d / "s.html"
    n_plots = html.read_text().count('<svg class="plot"')
    # throughput, output tokens, p99 TTFT/TPOT/E2EL and SLO attainment (--goodput) vs load, TTFT and E2EL CDFs
    assert n_plots == 8
    dom = _chrome(exe, tmp_path, "--dump-dom", html.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert f'<div id="plot-check">plots-ok {n_plots}</div>' in dom.stdout, dom.stdout[-3000:]
    shot = tmp_path / "s.png"
    s = _chrome(exe, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", html.as_uri())
    assert s.returncode == 0 and shot.is_file(), s.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 3000)
    hist = img.getcolors(maxcolors=1 << 24)
    n = img.size[0] * img.size[1]
    ink = sum(c for c, (r_, g, b) in hist if r_ + g + b < 600)
    blue = sum(c for c, (r_, g, b) in hist  # the first series' colour (#1f77b4), lines and markers
               if abs(r_ - 0x1f) < 40 and abs(g - 0x77) < 40 and abs(b - 0xb4) < 40)
    assert ink > 0.01 * n, "the screenshot is (nearly) blank"
    assert blue > 500, "no data series drawn in the screenshot"
    shutil.copy(shot, d / "s.png")  # kept next to the page for a look by eye


def test_report_and_compare_on_saved_files(sweep_run, tmp_path):
    r, d = sweep_run
    assert r.returncode == 0, r.stderr
    rep = bench("report", str(d / "s.json"), "--html", str(tmp_path / "again.html"))
    assert rep.returncode == 0, rep.stderr
    assert "capacity at SLA" in rep.stdout
    assert (tmp_path / "again.html").read_text() == (d / "s.html").read_text()
    rep = bench("report", str(d / "t.c2.jsonl"), "--html", str(tmp_path / "run.html"),
                "--result-json", str(tmp_path / "c2.json"))
    assert rep.returncode == 0, rep.stderr
    page = (tmp_path / "run.html").read_text()
    for title in ("TTFT histogram", "TTFT CDF", "TPOT histogram", "TPOT CDF", "ITL histogram", "ITL CDF",
                  "Latency over the run", "Request rate over the run"):
        assert f'data-title="{title}"' in page
    for metric in ("ttft", "tpot", "itl"):  # the report's latencies wear the dashboard's colours (inferd.web.style)
        assert f'fill="{ROLE[metric]}"' in page and f"--{metric}:{ROLE[metric]};" in theme_css()
    cmp_ = bench("compare", str(tmp_path / "c2.json"), str(d / "s.json"))
    assert cmp_.returncode == 0, cmp_.stderr
    assert "A = c2.json" in cmp_.stdout and "B = s.json (capacity c=4)" in cmp_.stdout
    row = next(line for line in cmp_.stdout.splitlines() if line.startswith("Peak concurrency"))
    assert row.split()[-4:] == ["2", "4", "+2", "2.000"]


def test_auto_sweep(mock, tmp_path):
    r = bench("--base-url", mock, "--num-prompts", "6", "--input-len", "16", "--output-len", "12",
              "--sweep", "auto:2", "--sla", "p99_ttft_ms<5000", "--result-json", str(tmp_path / "a.json"),
              "--progress")
    assert r.returncode == 0, r.stderr
    # forced on (stderr is a pipe here): a live line per point, ending complete (text mode reads \r as \n)
    assert "saturation [########################] 6/6" in r.stderr and "tok/s" in r.stderr
    doc = json.loads((tmp_path / "a.json").read_text())
    kinds = [p["kind"] for p in doc["points"]]
    assert kinds[0] == "sync" and kinds[-1] == "saturation" and kinds.count("rate") == 2
    xs = [p["x"] for p in doc["points"]]
    assert xs == sorted(xs)
    assert doc["capacity"]["label"] == "saturation"


@pytest.mark.parametrize("args,msg", [
    (["--sweep", "foo:1"], "bad --sweep 'foo:1'"),
    (["--sweep", "concurrency:"], "no concurrency values"),
    (["--sweep", "concurrency:2,0"], "must be an integer >= 1"),
    (["--sweep", "rate:1,x"], "must be > 0"),
    (["--html", "/nonexistent-dir/x.html"], "does not exist"),
    (["compare", "only.json"], "at least two"),
])
def test_bad_input_one_line_exit_2(args, msg):
    r = bench("--base-url", "http://127.0.0.1:9", *args)
    assert r.returncode == 2
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_compare_bad_files(tmp_path):
    good = tmp_path / "g.json"
    good.write_text(json.dumps({"completed": 1, "failed": 0, "mean_ttft_ms": 1.0}))
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    (tmp_path / "other.json").write_text('{"perplexity": 3.1}')
    for bad, msg in (("missing.json", "no such file"), ("t.jsonl", "is not JSON (a trace?"),
                     ("other.json", "is not an inferd bench result")):
        r = bench("compare", str(good), str(tmp_path / bad))
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- units ----------------------------------------------------------------------------------------
def test_parse_sweep():
    assert parse_sweep("concurrency:1,2,4") == ("concurrency", [1, 2, 4])
    assert parse_sweep("rate:0.5, 2,inf") == ("rate", [0.5, 2.0, float("inf")])
    assert parse_sweep("auto") == ("auto", [4]) and parse_sweep("auto:0") == ("auto", [0])
    for bad in ("", "auto:x", "concurrency:1.5", "concurrency:1,1", "load:1", "rate", "rate:-1"):
        with pytest.raises(InferdError):
            parse_sweep(bad)


def test_capacity_is_highest_passing_load_and_auto_rates():
    pts = [{"label": f"c={c}", "kind": "concurrency", "value": c, "x": c, "sla_ok": ok,
            "result": {"request_throughput": c * 1.0, "output_throughput": c * 10.0}}
           for c, ok in ((1, True), (2, True), (4, False), (8, True), (16, False))]
    assert capacity(pts)["label"] == "c=8"
    assert capacity([dict(p, sla_ok=False) for p in pts]) is None
    assert auto_rates(2.0, 10.0, 3) == [4.0, 6.0, 8.0]
    assert auto_rates(2.0, 2.01, 3) == [] and auto_rates(None, 5.0, 2) == []


EXPO = """# HELP inferd:time_to_first_token_seconds Time to first token.
# TYPE inferd:time_to_first_token_seconds histogram
inferd:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
inferd:time_to_first_token_seconds_sum{model_name="m"} %s
inferd:time_to_first_token_seconds_count{model_name="m"} %s
inferd:e2e_request_latency_seconds_sum{model_name="m"} %s
inferd:e2e_request_latency_seconds_count{model_name="m"} %s
vllm:request_queue_time_seconds_sum{model_name="a"} %s
vllm:request_queue_time_seconds_sum{model_name="b"} 1.0
vllm:request_queue_time_seconds_count{model_name="a"} %s
vllm:request_queue_time_seconds_count{model_name="b"} 2.0
inferd:num_requests_running{model_name="m"} 2.0
"""


def test_crosscheck_uses_window_deltas():
    before = parse_exposition(EXPO % (10.0, 100, 50.0, 100, 2.0, 10))
    after = parse_exposition(EXPO % (10.4, 104, 54.0, 104, 2.2, 14))
    assert before["vllm:request_queue_time_seconds_sum"] == 3.0  # label sets are summed
    res = {"completed": 4, "mean_ttft_ms": 110.0, "mean_e2el_ms": 1000.0, "mean_itl_per_token_ms": None}
    cc = crosscheck(res, before, after)
    assert cc["available"]
    m = cc["metrics"]
    assert m["ttft"]["server_count"] == 4 and m["ttft"]["server_mean_ms"] == pytest.approx(100.0)
    assert m["ttft"]["gap_pct"] == pytest.approx(10.0)
    assert m["e2el"]["server_mean_ms"] == pytest.approx(1000.0) and m["e2el"]["gap_pct"] == pytest.approx(0.0)
    assert m["queue"]["server_mean_ms"] == pytest.approx(50.0) and m["queue"]["client_mean_ms"] is None
    text = format_crosscheck(cc)
    assert "Mean TTFT" in text and "+10.0" in text
    assert not crosscheck(res, None, None)["available"]
    assert not crosscheck(res, before, before)["available"]  # nothing moved during the window


def test_crosscheck_against_a_server_that_has_served_nothing():
    """A labelled histogram has no series before its first observation: declared only, it counts as 0,
    so the first run against a fresh server still gets its cross-check."""
    fresh = parse_exposition("# HELP inferd:time_to_first_token_seconds TTFT.\n"
                             "# TYPE inferd:time_to_first_token_seconds histogram\n"
                             "# TYPE inferd:num_requests_running gauge\n")
    assert fresh == {"inferd:time_to_first_token_seconds_sum": 0.0, "inferd:time_to_first_token_seconds_count": 0.0}
    after = {"inferd:time_to_first_token_seconds_sum": 0.4, "inferd:time_to_first_token_seconds_count": 4.0}
    cc = crosscheck({"completed": 4, "mean_ttft_ms": 100.0}, fresh, after)
    assert cc["available"] and cc["metrics"]["ttft"]["server_mean_ms"] == pytest.approx(100.0)


def test_inferd_serve_exposes_its_latency_series_before_the_first_request():
    """Each engine's histograms exist at 0 from the start (as its gauges and counters do), as vLLM's do."""
    from inferd.server.metrics import Metrics

    text = Metrics("m", engines=2).render().decode()
    for e in ("0", "1"):
        assert f'inferd:e2e_request_latency_seconds_count{{engine="{e}",model_name="m"}} 0.0' in text
    assert parse_exposition(text)["inferd:time_to_first_token_seconds_count"] == 0.0


def test_progress_line_and_tty_rule():
    class FakeResp:
        status = 200
        events = [(1_000_000_000 + 50_000_000, b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":1}}'),
                  (1_000_000_000 + 70_000_000, b'{"choices":[{"text":"b"}],"usage":{"completion_tokens":3}}'),
                  (1_000_000_000 + 71_000_000, b'{"choices":[],"usage":{"completion_tokens":3}}'),
                  (1_000_000_000 + 71_000_000, b"[DONE]")]

    out = io.StringIO()
    p = Progress(2, stream=out)
    p.start(1_000_000_000)
    raw = [(0, 0, 0, 1_000_000_000, 0, FakeResp(), None, None, False), None]
    p.finished.append(0)
    p.tick(raw, 2_000_000_000, force=True)
    line = out.getvalue()
    assert line.startswith("\r") and "1/2" in line and "TTFT 50.0 ms" in line and "TPOT 10.00 ms" in line
    assert "3.0 tok/s" in line
    assert not want_progress(None, io.StringIO()) and want_progress(True, io.StringIO())
    assert not want_progress(False, sys.stderr)


def test_tick_labels_tell_ticks_apart():
    assert tick_labels(nice_ticks(4.9, 5.1)) == ["4.90", "4.95", "5.00", "5.05", "5.10"]
    assert tick_labels([84.0, 84.25, 84.5]) == ["84.00", "84.25", "84.50"]
    assert tick_labels([0.0, 10.0, 20.0]) == ["0", "10", "20"]


def test_compare_table_deltas():
    a = ("a.json", {"completed": 10, "mean_ttft_ms": 100.0, "request_throughput": 2.0})
    b = ("b.json", {"completed": 10, "mean_ttft_ms": 150.0, "request_throughput": 1.0})
    t = compare_table([a, b])
    row = next(x for x in t.splitlines() if x.startswith("Mean TTFT"))
    assert row.split()[-4:] == ["100.00", "150.00", "+50.00", "1.500"]
    with pytest.raises(InferdError):
        load_result("/nonexistent.json")
