// The dashboard shell: the session, the page switcher (one page shown at a time, by URL hash, so
// pages can be bookmarked and the back button works), and sign-out.
import { say, signOut, startSession } from "./api.js";
import { BackendsPage } from "./backends.js";
import { ExplainPage } from "./explain.js";
import { PolicyPage } from "./policy.js";
import { SpeculationPage } from "./speculation.js";
import { TrafficPage } from "./traffic.js";

const PAGES = { traffic: TrafficPage, speculation: SpeculationPage, policy: PolicyPage, explain: ExplainPage, backends: BackendsPage };
const built = {};
let current = null;

function route() {
  const name = location.hash.slice(1) in PAGES ? location.hash.slice(1) : "traffic";
  if (current && current !== name) built[current].hide();
  for (const key of Object.keys(PAGES)) {
    document.getElementById(`page-${key}`).hidden = key !== name;
    const link = document.querySelector(`[data-nav="${key}"]`);
    if (key === name) link.setAttribute("aria-current", "page"); else link.removeAttribute("aria-current");
  }
  if (!built[name]) built[name] = new PAGES[name](document.getElementById(`page-${name}`));
  const moved = current !== null && current !== name;
  current = name;
  document.title = `${name[0].toUpperCase()}${name.slice(1)} · specgate dashboard`;
  built[name].show();
  if (moved) document.getElementById(`h-${name}`).closest("section").querySelector("h1").focus({ preventScroll: false });
}

async function main() {
  const session = await startSession();
  if (!session) return;
  for (const h1 of document.querySelectorAll("section.page h1")) h1.tabIndex = -1;
  document.getElementById("signout").addEventListener("click", () => signOut().catch((e) => say(e.message, true)));
  window.addEventListener("hashchange", route);
  // Charts are drawn for a phone or a wider screen: redraw when the width crosses between them.
  matchMedia("(max-width: 599px)").addEventListener("change", () => { if (current) built[current].show(); });
  // Back to the sign-in form when the session runs out.
  setTimeout(() => location.assign("/admin/ui/login"), Math.min(2 ** 31 - 1, Math.max(0, session.expires_at * 1000 - Date.now()) + 1000));
  route();
}

main().catch((e) => say(`The dashboard failed to start: ${e.message}`, true));
