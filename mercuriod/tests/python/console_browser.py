"""The web console in a real browser: headless chromium driven by selenium through
chromedriver, against a running mercuriod (started by mercuriod/tests/mercuriod/console.rs).

Arguments: BASE_URL (http://127.0.0.1:PORT) SCREENSHOT_DIR VICTIM_CLIENT_ID.
Prints one line per step; the Rust test reacts to these lines:
  REFUSED          wrong credentials got an error and no data
  LOGGED_IN
  CLIENT_LISTED    the victim's row is in the clients table
  DISCONNECTED     the page disconnected it and said so
  PUBLISH_NOW      the messages/s graph sampled only zeros so far: start the publisher
  GRAPH_MOVED n    the graph's data (the page's state) has a rate above zero
  VIEWER_SAW       the message viewer was refused secret/# (ACL) and shows load/x messages
Exits 0 when every step passed; a failed step prints FAIL and exits 1.
"""

import os
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

DEADLINE = 20


def step(text):
    print(text, flush=True)


def main():
    base, shots, victim = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(shots, exist_ok=True)
    # Nothing may be fetched from outside: no Selenium Manager download either.
    os.environ["SE_OFFLINE"] = "true"
    profile = tempfile.mkdtemp(prefix="mercurio-console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    for flag in [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        "--user-data-dir=" + profile,
    ]:
        options.add_argument(flag)
    service = Service(executable_path=os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(DEADLINE)
    try:
        run(driver, base, shots, victim)
    finally:
        driver.quit()


def shot(driver, shots, name):
    path = os.path.join(shots, name)
    driver.save_screenshot(path)
    step("SCREENSHOT " + path)


def wait(driver, what, cond):
    try:
        return WebDriverWait(driver, DEADLINE, poll_frequency=0.1).until(lambda d: cond(d))
    except Exception:
        step("FAIL waiting for " + what)
        logs = driver.execute_script("return document.body.innerText")
        step("PAGE " + " | ".join(logs.splitlines()))
        raise


def state(driver, expr):
    return driver.execute_script("return window.mercurioConsole." + expr)


def log_in(driver, user, password):
    driver.find_element(By.ID, "user").clear()
    driver.find_element(By.ID, "user").send_keys(user)
    driver.find_element(By.ID, "password").clear()
    driver.find_element(By.ID, "password").send_keys(password)
    driver.find_element(By.ID, "login-button").click()


def run(driver, base, shots, victim):
    # Sample every half second so that the graph moves within the test's deadline.
    driver.get(base + "/console/?interval=0.5")
    assert driver.title == "Mercurio console", driver.title

    # Wrong credentials: an error, no data of the broker anywhere in the page or its state.
    for user, password, expected in [
        ("alice", "wrong", "Wrong user, password or token."),
        ("bob", "builder", "This user is not an admin."),
    ]:
        log_in(driver, user, password)
        wait(driver, "the login error for " + user,
             lambda d: d.find_element(By.ID, "login-error").text == expected)
        assert not driver.find_element(By.ID, "nav").is_displayed(), "navigation shown"
        assert state(driver, "status") is None, "status kept"
        assert state(driver, "samples.length") == 0, "samples taken"
        assert state(driver, "clients.length") == 0, "clients listed"
        assert victim not in driver.page_source, "a refused login shows broker data"
    shot(driver, shots, "01-login-refused.png")
    step("REFUSED")

    log_in(driver, "alice", "wonderland")
    wait(driver, "the overview", lambda d: d.find_element(By.ID, "overview").is_displayed())
    wait(driver, "the facts", lambda d: "Clients" in d.find_element(By.ID, "facts").text)
    step("LOGGED_IN")

    # The clients table lists the victim; filter to it.
    driver.find_element(By.CSS_SELECTOR, "nav button[data-view=clients]").click()
    row_selector = 'tr[data-client="%s"]' % victim

    def listed(d):
        rows = d.find_elements(By.CSS_SELECTOR, row_selector)
        if not rows:
            d.find_element(By.ID, "clients-refresh").click()
        return rows

    wait(driver, "the victim's row", listed)
    driver.find_element(By.ID, "client-filter").send_keys(victim[:4])
    row = driver.find_element(By.CSS_SELECTOR, row_selector)
    assert "yes" in row.text, row.text
    row.find_element(By.CSS_SELECTOR, "button.show").click()
    wait(driver, "the client's detail",
         lambda d: victim in d.find_element(By.ID, "client-detail").text)
    shot(driver, shots, "02-clients.png")
    step("CLIENT_LISTED")

    # Disconnect: one click arms the button, the second acts.
    button = driver.find_element(By.CSS_SELECTOR, row_selector + " button.danger")
    button.click()
    wait(driver, "the confirmation", lambda d: "Confirm" in button.text)
    button.click()
    wait(driver, "the page's confirmation",
         lambda d: d.find_element(By.ID, "message").text == "Disconnected %s." % victim)
    shot(driver, shots, "03-disconnected.png")
    step("DISCONNECTED")

    # The messages/s graph: zeros while nothing is published, then above zero.
    driver.find_element(By.CSS_SELECTOR, "nav button[data-view=overview]").click()
    wait(driver, "three rate samples", lambda d: state(d, "series.received.length") >= 3)
    before = state(driver, "series.received.map(p => p.v)")
    assert max(before) == 0, "messages/s before any publisher: %r" % before
    step("PUBLISH_NOW")
    wait(driver, "a rate above zero",
         lambda d: max(state(d, "series.received.map(p => p.v)")) > 0)
    wait(driver, "a few samples of the load", lambda d: state(d, "series.received.length") >= len(before) + 4)
    rates = state(driver, "series.received.map(p => p.v)")
    shot(driver, shots, "04-overview-under-load.png")
    step("GRAPH_MOVED %.1f" % max(rates))

    # The message viewer subscribes as alice over MQTT over WebSocket: her ACL refuses
    # secret/#, lets her read load/#.
    driver.find_element(By.CSS_SELECTOR, "nav button[data-view=messages]").click()
    watch_filter = driver.find_element(By.ID, "watch-filter")
    watch_filter.clear()
    watch_filter.send_keys("secret/#")
    driver.find_element(By.ID, "watch-start").click()
    wait(driver, "the refused subscription",
         lambda d: "refused (not authorized)" in d.find_element(By.ID, "watch-state").text)
    driver.find_element(By.ID, "watch-stop").click()
    watch_filter.clear()
    watch_filter.send_keys("load/#")
    driver.find_element(By.ID, "watch-start").click()
    wait(driver, "the subscription",
         lambda d: d.find_element(By.ID, "watch-state").text == "watching load/#")
    wait(driver, "a load/x message in the table",
         lambda d: "load/x" in d.find_element(By.ID, "messages-table").text)
    tree = driver.find_element(By.ID, "topic-tree").text
    assert "load" in tree and "secret" not in tree, tree
    assert state(driver, "watch.messages.every(m => m.topic === 'load/x')"), "other topics shown"
    shot(driver, shots, "05-messages.png")
    driver.find_element(By.ID, "watch-stop").click()
    step("VIEWER_SAW")

    # The other views render.
    for view in ["sessions", "bridges"]:
        driver.find_element(By.CSS_SELECTOR, "nav button[data-view=%s]" % view).click()
        wait(driver, view, lambda d: d.find_element(By.ID, view).is_displayed())
    shot(driver, shots, "06-bridges.png")

    # Logging out forgets everything.
    driver.find_element(By.ID, "logout").click()
    wait(driver, "the login form", lambda d: d.find_element(By.ID, "login").is_displayed())
    assert state(driver, "auth") is None, "credentials kept after logging out"
    step("DONE")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the step lines say where; this says why
        step("FAIL %s: %s" % (type(e).__name__, e))
        sys.exit(1)
