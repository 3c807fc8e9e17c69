"""/dashboard in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`, driven by
selenium) loads the page against a server under load; the numbers it shows must be /metrics' numbers.
Skips, saying why, where Chromium or selenium is missing (a plain `make test` elsewhere; `.ci/run` installs them).

Set KVSERVE_DASHBOARD_SCREENSHOT=docs/dashboard.png to refresh the README's screenshot."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from kvserve.engine.kv_snapshot import SnapshotSampler, pool_summary
from tests.server_utils import RemoteServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
API_KEY = "dash-key"
PAGE_STATS = {  # element id on the page -> /metrics sample
    "num-running": "kvserve:num_requests_running",
    "num-waiting": "kvserve:num_requests_waiting",
    "kv-usage": "kvserve:kv_cache_usage_perc",
    "prompt-tokens": "kvserve:prompt_tokens_total",
    "generation-tokens": "kvserve:generation_tokens_total",
    "prefix-hits": "kvserve:prefix_cache_hits_total",
    "prefix-queries": "kvserve:prefix_cache_queries_total",
    "preemptions": "kvserve:num_preemptions_total",
}


# ---- the snapshot itself (no browser) ----------------------------------------------------------------------
class _Block:
    def __init__(self, ref, cached):
        self.ref_cnt, self.block_hash = ref, (b"h" if cached else None)


class _Pool:
    def __init__(self, blocks):
        self.blocks, self.num_blocks = blocks, len(blocks)

    def usage(self):
        return sum(b.ref_cnt > 0 for b in self.blocks) / self.num_blocks


def test_pool_summary_counts_and_caps_cells():
    blocks = [_Block(0, False)] * 5 + [_Block(0, True)] * 3 + [_Block(1, True)] * 4 + [_Block(3, True)] * 2
    s = pool_summary(_Pool(blocks), max_cells=100)
    assert (s["free"], s["cached"], s["used"], s["shared"]) == (5, 3, 4, 2)
    assert s["cells"] == "fffffcccuuuuss" and s["blocks_per_cell"] == 1
    assert s["shared_refs"] == {12: 3, 13: 3} and s["ref_histogram"] == {3: 2}
    # A million-token cache (62,500 blocks of 16) still yields at most max_cells cells.
    big = pool_summary(_Pool([_Block(0, False)] * 62_000 + [_Block(1, False)] * 500), max_cells=2048)
    assert len(big["cells"]) <= 2048 and big["blocks_per_cell"] == 31 and big["used"] == 500
    assert big["cells"].endswith("u" * (500 // 31))


def test_sampler_rate_limits_and_sends_the_idle_picture():
    clock = [0.0]

    class Engine:
        busy = True
        scheduler = kv_cache_manager = None

        def has_unfinished_requests(self):
            return self.busy

    import kvserve.engine.kv_snapshot as ks

    taken = []
    orig = ks.take_snapshot
    ks.take_snapshot = lambda engine: taken.append(clock[0]) or {"t": clock[0]}
    try:
        sampler, engine = SnapshotSampler(0.5, clock=lambda: clock[0]), Engine()
        for t in (0.0, 0.1, 0.2, 0.6, 0.7, 1.2):
            clock[0] = t
            sampler.maybe_take(engine)
        engine.busy = False
        clock[0] = 1.3
        sampler.maybe_take(engine)  # went idle: one more, right away
        clock[0] = 5.0
        sampler.maybe_take(engine)  # still idle: nothing new to show
    finally:
        ks.take_snapshot = orig
    assert taken == [0.0, 0.6, 1.2, 1.3]


# ---- the page in Chromium --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium not installed (apt-get install chromium chromium-driver; .ci/run does)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_AVOID_STATS", "true")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1150,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    # 40 blocks of 16 tokens: 12 sequences of ~160 tokens do not fit at once, so some are preempted.
    srv = RemoteServer(path, "--served-model-name", "tiny-llama", "--max-model-len", "512", "--num-gpu-blocks-override", "40", "--max-num-seqs", "8",
                       api_key=API_KEY)
    yield srv
    srv.stop()


def _metrics(server) -> dict[str, float]:
    """One scrape of /metrics: the page's samples."""
    samples = server.metrics()
    # Summed over label sets (kvserve:num_preemptions_total has one series per preemption mode).
    return {name: sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))
            for name in PAGE_STATS.values()}


def _page_values(driver) -> dict[str, float]:
    out = {}
    for el_id, name in PAGE_STATS.items():
        raw = driver.find_element("id", el_id).get_attribute("data-value")
        out[name] = float(raw) if raw else float("nan")
    return out


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def test_snapshot_needs_the_api_key(server):
    assert httpx.get(server.url + "/dashboard/snapshot", timeout=30).status_code == 401
    assert httpx.get(server.url + "/dashboard/snapshot", headers=server.headers(), timeout=30).status_code == 200
    page = httpx.get(server.url + "/dashboard", timeout=30)  # the shell holds no data
    assert page.status_code == 200 and "/dashboard/snapshot" in page.text


def test_page_under_load_shows_metrics_numbers(server, browser):
    shared_prefix = list(range(100, 148))  # 3 full blocks every prompt shares: prefix-cache hits
    errors: list[BaseException] = []

    def one(i: int):
        try:
            body = {"prompt": shared_prefix + [200 + i] * (10 + i), "max_tokens": 100, "ignore_eos": True,
                    "temperature": 0, "n": 2 if i % 2 else 1}
            r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=300)
            assert r.status_code == 200, r.text
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        browser.get(f"{server.url}/dashboard#key={API_KEY}")

        def busy_page():
            rows = browser.find_elements("css selector", "#request-rows tr")
            used = browser.find_element("id", "blocks-used").get_attribute("data-value")
            shared = browser.find_element("id", "blocks-shared").get_attribute("data-value")
            return rows and used and shared and int(used) + int(shared) > 0

        _wait(busy_page, 120, "the page never showed requests holding blocks")
        during = _page_values(browser)
        after = _metrics(server)
        # Under load the page trails /metrics by at most its refresh: counters never ahead of the server.
        for name in ("kvserve:prompt_tokens_total", "kvserve:generation_tokens_total"):
            assert 0 <= during[name] <= after[name], name
        shot = os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT")
        if shot:
            browser.save_screenshot(shot)
    finally:
        for t in threads:
            t.join(300)
    assert not errors, errors[0]

    # At rest the page settles on exactly the server's numbers.
    final = _wait(lambda: (m := _metrics(server))["kvserve:num_requests_running"] == 0 and m, 60, "server not idle")
    _wait(lambda: _page_values(browser) == final, 30,
          f"page never matched /metrics: page {_page_values(browser)} vs {final}")
    assert final["kvserve:prefix_cache_hits_total"] > 0 and final["kvserve:generation_tokens_total"] == 12 * 100
    assert final["kvserve:num_preemptions_total"] > 0
    # The block pool at rest: nothing in use, the shared prefix still cached (evictable), counts add up.
    pool = {k: int(browser.find_element("id", f"blocks-{k}").get_attribute("data-value"))
            for k in ("free", "cached", "used", "shared")}
    assert pool["used"] == pool["shared"] == 0 and pool["cached"] >= 3 and sum(pool.values()) == 40
    assert browser.find_elements("css selector", "#request-rows tr") == []
