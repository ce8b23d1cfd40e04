"""The router's dashboard in a real browser: headless Chromium (Debian's package, installed if
missing by scripts/ensure_chromium.sh, driven by Playwright) against `shoal serve` of the tiny model
with two replicas. The page refuses a wrong token with a clear message; with the admin token (in
the URL fragment, which never reaches the server) it shows both workers healthy, lists requests as
they finish, draws one request's spans as a waterfall, and shows a worker killed with SIGKILL as
down or gone, with an event for it in the feed, then its replacement serving."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import openai
import pytest
from playwright.sync_api import expect, sync_playwright

from tests.support.serving import supervised

ENSURE_CHROMIUM = Path(__file__).resolve().parents[2] / "scripts" / "ensure_chromium.sh"
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def chromium() -> str:
    return (
        subprocess.run([str(ENSURE_CHROMIUM)], check=True, capture_output=True, text=True, timeout=900)
        .stdout.strip()
        .splitlines()[-1]
    )


@pytest.fixture
def browser(chromium):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield browser
        browser.close()


def test_the_dashboard_shows_the_cluster_its_requests_and_a_killed_worker(deploy, browser):
    _, url, state_dir, _ = deploy(replicas=2)
    token = json.loads((state_dir / "serve" / "serve.json").read_text())["admin_token"]
    workers = [slot["url"] for slot in supervised(state_dir)]

    refused = browser.new_page()
    refused.goto(f"{url}/dashboard#token=not-the-token")
    expect(refused.locator("#auth")).to_be_visible(timeout=WAIT_MS)
    expect(refused.locator("#auth-message")).to_contain_text("not accepted")
    expect(refused.locator("#main")).to_be_hidden()
    refused.close()

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    sent = []
    page.on("request", lambda request: sent.append(request.url))
    page.goto(f"{url}/dashboard#token={token}")
    for worker in workers:
        expect(page.locator(f'#workers tr[data-worker-id="{worker}"]')).to_have_attribute(
            "data-status", "healthy", timeout=WAIT_MS
        )
    assert "token" not in page.url  # taken out of the address bar once stored

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(3):
        answer = client.completions.create(
            model="tiny", prompt=f"hello {i}", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert answer.usage.completion_tokens == 8
    streamed = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert sum(1 for _ in streamed) > 0
    requests = page.locator("#requests tbody tr[data-trace-id]")
    expect(requests).to_have_count(4, timeout=WAIT_MS)
    expect(requests.first.locator("td").nth(2)).to_contain_text("200")
    requests.nth(1).click()  # a completion finished a moment before the stream: its worker's spans have ended
    waterfall = page.locator("#waterfall")
    expect(waterfall.locator('.wf-row[data-span-name="router.request"]')).to_have_count(1, timeout=WAIT_MS)
    expect(waterfall.locator('.wf-row[data-span-name="router.attempt"]')).to_have_count(1)
    expect(waterfall.locator('.wf-row[data-span-name="worker.request"]')).to_have_count(1)  # fetched from the worker
    waterfall.locator('.wf-row[data-span-name="router.attempt"]').click()
    expect(page.locator("#span-detail")).to_contain_text("shoal.worker")

    victim = supervised(state_dir)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    expect(page.locator(f'#workers tr[data-worker-id="{victim["url"]}"]')).to_have_attribute(
        "data-status", re.compile(r"^(down|gone)$"), timeout=WAIT_MS
    )
    feed = page.locator(f'#events li[data-worker-id="{victim["url"]}"]')
    expect(feed.and_(page.locator('[data-change="exited"], [data-change="down"]')).first).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#events")).to_contain_text(f"exited with {-signal.SIGKILL}")
    expect(page.locator('#workers tr[data-status="healthy"]')).to_have_count(2, timeout=3 * WAIT_MS)  # restarted

    assert sent and not [u for u in sent if token in u]  # the token travels in a header only
