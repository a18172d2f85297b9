"""The web chat page in headless Chromium: send a message, see the streamed reply, a second
turn with history, the stop button, the model name, a finish marker and tokens/s under each
reply, markdown rendered without letting model output inject HTML, the conversation kept
across a reload, the live lanes view, and no failed request (favicon included).

Needs Debian's `chromium` (/usr/bin/chromium) and the `playwright` Python package; never
downloads a browser. Skipped cleanly when either is missing (CI: `apt-get install -y
chromium` and `pip install playwright`).
"""

from __future__ import annotations

import re
import shutil
import time

import pytest
import pytest_asyncio

from .server_helpers import MODEL_NAME, live_server, open_engine, wait_idle

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
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.on("console", lambda m: failed.append(m.text) if m.type == "error" else None)
    await page.goto(page_url)
    await page.wait_for_function("document.getElementById('status').textContent === 'connected'")
    await page.fill("#temperature", "0")
    await page.fill("#max-tokens", "12")
    yield page
    assert not failed, failed  # no 404 (favicon), no console error
    await page.close()


async def send_and_wait(page, text: str) -> str:
    await page.fill("#input", text)
    await page.click("#send")
    reply = page.locator(".msg.assistant").last
    await page.wait_for_function(
        "document.querySelectorAll('.msg.assistant[data-finish-reason]').length"
        f" === {await page.locator('.msg.assistant').count()}")
    return await reply.get_attribute("data-raw")  # the streamed text (shown as markdown)


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
    assert (await page.request.get(page.url + "favicon.ico")).status == 200
    await wait_idle(engine)


async def test_page_shows_the_model_and_a_finish_marker_and_rate(engine, browser, page_url):
    page = await browser.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    await page.add_init_script(IGNORE_EOS_SCRIPT)
    await page.goto(page_url)
    await page.wait_for_function("document.getElementById('status').textContent === 'connected'")
    await page.wait_for_function(f"document.getElementById('model').textContent === '{MODEL_NAME}'")
    await page.fill("#max-tokens", "7")
    await send_and_wait(page, "Count")
    reply = page.locator(".msg.assistant").last
    assert await reply.get_attribute("data-finish-reason") == "length"
    meta = await page.locator(".turn.assistant .meta").last.text_content()
    assert "stopped at max tokens" in meta, meta
    assert re.search(r"7 tokens · [0-9.]+ tok/s", meta), meta
    await page.close()


MARKDOWN_REPLY = (
    "**bold** and `code` <img src=x onerror=\"window.__xss=1\"> "
    "[bad](javascript:window.__xss=2) [ok](https://example.org/)\n\n"
    "```html\n<script>window.__xss=3</script>\n```\n- one\n- <b>two</b>\n")
REWRITE_REPLY_SCRIPT = """
// The model's first delta is replaced by markdown carrying HTML, as a model might write it.
const realOnmessage = Object.getOwnPropertyDescriptor(WebSocket.prototype, "onmessage");
Object.defineProperty(WebSocket.prototype, "onmessage", {
  set(handler) {
    let first = true;
    realOnmessage.set.call(this, (event) => {
      const msg = JSON.parse(event.data);
      if (msg.type === "delta" && first) { first = false; msg.text = window.__reply; }
      else if (msg.type === "delta") msg.text = "";
      handler({data: JSON.stringify(msg)});
    });
  },
});
"""


async def test_markdown_is_rendered_and_cannot_inject_html(engine, browser, page_url):
    page = await browser.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    await page.add_init_script(f"window.__reply = {MARKDOWN_REPLY!r};" + REWRITE_REPLY_SCRIPT)
    await page.goto(page_url)
    await page.wait_for_function("document.getElementById('status').textContent === 'connected'")
    assert await send_and_wait(page, "Show me") == MARKDOWN_REPLY
    reply = page.locator(".msg.assistant").last
    for _ in range(2):  # as streamed, then as restored from local storage after a reload
        assert await reply.locator("strong").text_content() == "bold"
        assert await reply.locator("pre code").text_content() == "<script>window.__xss=3</script>"
        assert await reply.locator("li").all_text_contents() == ["one", "<b>two</b>"]
        assert await reply.locator("a").count() == 1
        assert await reply.locator("a").get_attribute("href") == "https://example.org/"
        assert await reply.locator("img, script, b").count() == 0
        assert "<img src=x" in await reply.text_content()
        assert await page.evaluate("window.__xss") is None
        await page.reload()
        await page.wait_for_function("document.querySelectorAll('.msg').length === 2")
    assert await page.locator(".msg.user").all_text_contents() == ["Show me"]
    await page.close()


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
        "document.querySelector('.turn:last-child .msg').textContent.length > 0")
    # The lanes view shows the busy lane while the reply streams, and all free after.
    await page.wait_for_function("document.querySelectorAll('#lanes .lane.busy').length === 1")
    assert await page.locator("#lanes .lane").count() == 2
    await page.click("#stop")
    await page.wait_for_function(
        "document.querySelector('.turn:last-child .msg').dataset.finishReason === 'cancelled'")
    assert "stopped" in (await reply.get_attribute("class"))
    assert "stopped" in await page.locator(".turn:last-child .meta").text_content()
    await page.wait_for_function("document.querySelectorAll('#lanes .lane.busy').length === 0")
    assert "queue 0" in await page.locator("#pool").text_content()
    assert await page.is_enabled("#send") and not await page.is_enabled("#stop")
    await wait_idle(engine)
    await page.close()
