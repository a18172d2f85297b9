"""The web chat page in headless Chromium: send a message, see the streamed reply, a second
turn with history, and the stop button.

Needs Debian's `chromium` (/usr/bin/chromium) and the `playwright` Python package; never
downloads a browser. Skipped cleanly when either is missing (CI: `apt-get install -y
chromium` and `pip install playwright`).
"""

from __future__ import annotations

import shutil
import time

import pytest
import pytest_asyncio

from .server_helpers import live_server, open_engine, wait_idle

playwright_api = pytest.importorskip("playwright.async_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)"),
]
TIMEOUT_MS = 30_000


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_page"), parallel=2, ctx=512) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def page_url(engine):
    async with live_server(engine) as url:
        yield url + "/"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser():
    async with playwright_api.async_playwright() as pw:
        chromium = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield chromium
        await chromium.close()


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser, page_url):
    page = await browser.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    await page.goto(page_url)
    await page.wait_for_function("document.getElementById('status').textContent === 'connected'")
    await page.fill("#temperature", "0")
    await page.fill("#max-tokens", "12")
    yield page
    await page.close()


async def send_and_wait(page, text: str) -> str:
    await page.fill("#input", text)
    await page.click("#send")
    reply = page.locator(".msg.assistant").last
    await page.wait_for_function(
        "document.querySelectorAll('.msg.assistant[data-finish-reason]').length"
        f" === {await page.locator('.msg.assistant').count()}")
    return await reply.text_content()


async def test_page_streams_a_reply_and_keeps_history(engine, page):
    first = await send_and_wait(page, "Hello there")
    turn1 = [{"role": "user", "content": "Hello there"}]
    expected1 = await engine.chat_complete(turn1, max_tokens=12, temperature=0)
    assert first == expected1.text
    second = await send_and_wait(page, "And then?")
    turn2 = turn1 + [{"role": "assistant", "content": first},
                     {"role": "user", "content": "And then?"}]
    assert second == (await engine.chat_complete(turn2, max_tokens=12, temperature=0)).text
    assert await page.locator(".msg.user").all_text_contents() == ["Hello there", "And then?"]
    await wait_idle(engine)


IGNORE_EOS_SCRIPT = """
const realSend = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  const msg = JSON.parse(data);
  if (msg.type === "chat") msg.ignore_eos = true;  // a reply long enough to stop
  return realSend.call(this, JSON.stringify(msg));
};
"""


async def test_stop_button_stops_the_reply(engine, browser, page_url):
    # Throttle the engine (5 ms a round) so that the reply is still streaming when Stop is clicked.
    engine.parts.runner.fault_injector = lambda rows: time.sleep(0.005)
    try:
        await _click_stop_mid_reply(engine, browser, page_url)
    finally:
        engine.parts.runner.fault_injector = None


async def _click_stop_mid_reply(engine, browser, page_url):
    page = await browser.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    await page.add_init_script(IGNORE_EOS_SCRIPT)
    await page.goto(page_url)
    await page.wait_for_function("document.getElementById('status').textContent === 'connected'")
    await page.fill("#max-tokens", "450")
    await page.fill("#input", "Talk for a long time")
    await page.click("#send")
    reply = page.locator(".msg.assistant").last
    await page.wait_for_function(
        "document.querySelector('.msg.assistant:last-child').textContent.length > 0")
    await page.click("#stop")
    await page.wait_for_function(
        "document.querySelector('.msg.assistant:last-child').dataset.finishReason === 'cancelled'")
    assert "stopped" in (await reply.get_attribute("class"))
    assert await page.is_enabled("#send") and not await page.is_enabled("#stop")
    await wait_idle(engine)
    await page.close()
