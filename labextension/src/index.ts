/**
 * The gpusnap status-bar item and side panel: where this server stands (active, idle and when it
 * will be suspended, parked, restored from a snapshot), what the service sees, and two actions:
 * keep running for a while, or suspend now. Everything goes through the server extension's
 * /gpusnap/* handlers, whose polling does not count as activity.
 *
 * Two more jobs:
 * - the forgotten tab: once the server is suspended under an open tab (the Hub answers 424 for
 *   it), the tab asks the service itself and says so ("suspended at T to free the GPU; your
 *   kernels are saved"), in place of JupyterLab's "Server unavailable… Restart?" (this plugin
 *   provides IConnectionLost; package.json disables the Hub extension's). "Restore" starts the
 *   server through the Hub in a hidden frame of this tab and, once it answers, reconnects the
 *   open notebooks to their kernels: no reload, no second tab.
 * - interaction: keys, clicks and wheel scrolling in this tab while it is visible are reported
 *   (throttled) as their own signal, so a user reading their notebook is not suspended.
 */
import { IConnectionLost, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import {
  defaultKeep,
  formatBytes,
  formatClock,
  formatCountdown,
  formatDuration,
  gpuMemoryLine,
  history,
  idleSeconds,
  IStatus,
  keepChoices,
  probeServer,
  stateWords,
  statusLine
} from './format';
import { countsAsInteraction, INTERACTION_EVENTS, InteractionReporter } from './interaction';

const POLL_MS = 10000;
/** While parked, how often the panel asks the server extension (not the service) whether a
 * cell brought the GPU memory back: "resuming…" lasts about as long as the driver's restore. */
const UNPARK_POLL_MS = 1000;
const PANEL_ID = 'gpusnap-panel';
/** While restoring from the tab, how often to ask whether the server answers again. */
const RESTORE_POLL_MS = 2000;
const RESTORE_GIVE_UP_MS = 10 * 60 * 1000;

/** An error answer of the server extension (or of the Hub in its place), with its status. */
class RequestError extends Error {
  constructor(message: string, readonly status: number) {
    super(message);
  }
}

/** Where the tab reaches the service once the server, and its /gpusnap handlers, are gone. */
interface IServiceAccess {
  url: string;
  token: string;
  server: string;
}

const sleep = (ms: number) => new Promise(resolve => setTimeout(resolve, ms));

const icon = new LabIcon({
  name: 'jupyterhub-gpusnap:icon',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<path d="M4 7h16v10H4zM2 9h2v2H2zM2 13h2v2H2zM20 9h2v2h-2zM20 13h2v2h-2zM7 4h2v3H7zM11 4h2v3h-2zM15 4h2v3h-2z' +
    'M7 17h2v3H7zM11 17h2v3h-2zM15 17h2v3h-2z"/></g><path d="M9 10h6v4H9z" fill="var(--jp-layout-color1, #fff)"/></svg>'
});

/** Talks to the server extension and shares the latest status with the views. */
class Model {
  status: IStatus | null = null;
  error: string | null = null;
  busy = false;
  /** The Hub says this server is not running (its answers come from the service, if any). */
  gone = false;
  /** Polls since the server went (most ask the service only: see probeServer). */
  private gonePolls = 0;
  restoring = false;
  /** Called once the server answers again after being gone. */
  onBack: () => Promise<void> = async () => undefined;
  private service: IServiceAccess | null = null;
  private listeners: Array<() => void> = [];
  private settings = ServerConnection.makeSettings();

  onChange(f: () => void): void {
    this.listeners.push(f);
  }

  emit(): void {
    this.listeners.forEach(f => f());
  }

  private async request(path: string, init: RequestInit = {}): Promise<any> {
    const url = URLExt.join(this.settings.baseUrl, 'gpusnap', path);
    const resp = await ServerConnection.makeRequest(url, init, this.settings);
    const data = await resp.json().catch(() => ({}));
    if (!resp.ok) {
      throw new RequestError(data.message || `${resp.status} ${resp.statusText}`, resp.status);
    }
    return data;
  }

  async refresh(): Promise<void> {
    if (this.gone && !this.restoring) {
      const known = await this.fromService();
      if (!probeServer(known, ++this.gonePolls)) {
        this.status = known;
        this.emit();
        return;
      }
    }
    try {
      const status = await this.request('status');
      const back = this.gone;
      this.status = status;
      this.error = null;
      this.gone = false;
      this.gonePolls = 0;
      if (!this.service) {
        this.service = await this.request('service').catch(() => null);
      }
      if (back && !this.restoring) {
        await this.onBack(); // restored elsewhere (another tab, the Hub's home page)
      }
    } catch (e) {
      const status = e instanceof RequestError ? e.status : 0;
      if (status === 424 || status === 503) {
        // JupyterHub: this server is not running. Ask the service why, not the stale copy.
        this.gone = true;
        this.error = null;
        this.status = await this.fromService();
      } else {
        this.error = (e as Error).message;
      }
    }
    this.emit();
  }

  /** The service's own status of this server (null if it cannot be asked). */
  private async fromService(): Promise<IStatus | null> {
    if (!this.service) {
      return null;
    }
    try {
      const resp = await fetch(this.service.url, {
        headers: { Authorization: `token ${this.service.token}` },
        credentials: 'omit',
        cache: 'no-store'
      });
      return resp.ok ? await resp.json() : null;
    } catch (e) {
      return null;
    }
  }

  /** The user used this tab (a trusted key, click or wheel while visible); throttled by the caller. */
  async reportInteraction(): Promise<void> {
    if (this.gone) {
      return;
    }
    try {
      await this.request('interaction', { method: 'POST', body: '{}' });
    } catch (e) {
      // the next status poll shows what is wrong
    }
  }

  /**
   * Start the server again from this tab: the Hub's own spawn page (which restores the
   * snapshot) in a hidden frame, with the user's Hub login; then wait until the server answers.
   */
  async restore(): Promise<boolean> {
    if (this.restoring) {
      return false;
    }
    this.restoring = true;
    this.error = null;
    this.emit();
    const hub = PageConfig.getOption('hubHost') + PageConfig.getOption('hubPrefix');
    const user = encodeURIComponent(PageConfig.getOption('hubUser'));
    const name = PageConfig.getOption('hubServerName');
    const next = URLExt.join(this.settings.baseUrl, 'gpusnap', 'back');
    const frame = document.createElement('iframe');
    frame.className = 'jp-gpusnap-restore-frame';
    frame.title = 'Restoring your server';
    frame.setAttribute('aria-hidden', 'true');
    frame.src =
      URLExt.join(hub, 'spawn', user, name ? encodeURIComponent(name) : '') + `?next=${encodeURIComponent(next)}`;
    document.body.append(frame);
    const start = Date.now();
    let back = false;
    try {
      while (!back && Date.now() - start < RESTORE_GIVE_UP_MS) {
        await sleep(RESTORE_POLL_MS);
        try {
          this.status = await this.request('status');
          back = true;
        } catch (e) {
          const status = await this.fromService();
          if (status) {
            this.status = status;
          }
          this.emit();
        }
      }
    } finally {
      frame.remove();
    }
    if (back) {
      this.gone = false;
      await this.onBack();
    } else {
      this.error = 'The server did not come back: open the Hub home page to see why.';
    }
    this.restoring = false;
    await this.refresh();
    return back;
  }

  /** While the server is parked (or resuming), refresh only the automatic unpark's state. */
  async refreshUnpark(): Promise<void> {
    const s = this.status;
    if (!s || !(s.state === 'parked' || s.autounpark?.resuming)) {
      return;
    }
    try {
      const autounpark = await this.request('autounpark');
      if (this.status === s) {
        this.status = { ...s, autounpark };
        this.emit();
      }
    } catch (e) {
      // the next full refresh reports what is wrong
    }
  }

  async act(path: 'keep' | 'suspend', body: object = {}): Promise<void> {
    this.busy = true;
    this.emit();
    try {
      await this.request(path, { method: 'POST', body: JSON.stringify(body) });
      this.error = null;
    } catch (e) {
      this.error = (e as Error).message;
    } finally {
      this.busy = false;
    }
    await this.refresh();
  }
}

/** h('p', {class: 'x'}, 'text', child): a tiny DOM builder. */
function h(tag: string, attrs: { [k: string]: string } = {}, ...children: Array<Node | string>): HTMLElement {
  const el = document.createElement(tag);
  Object.entries(attrs).forEach(([k, v]) => el.setAttribute(k, v));
  children.forEach(c => el.append(c));
  return el;
}

class StatusItem extends Widget {
  constructor(private model: Model, open: () => void) {
    super({ node: document.createElement('button') });
    this.addClass('jp-gpusnap-status');
    this.node.setAttribute('type', 'button');
    this.node.setAttribute('title', 'GPU snapshot status: open the details');
    this.node.addEventListener('click', open);
    model.onChange(() => this.render());
    this.render();
  }

  render(): void {
    const m = this.model;
    const text = lineOf(m, Date.now());
    this.node.textContent = text;
    this.node.dataset.state = m.status?.state || 'unknown';
    this.node.setAttribute('aria-label', text);
  }
}

class Panel extends Widget {
  constructor(private model: Model) {
    super();
    this.id = PANEL_ID;
    this.addClass('jp-gpusnap-panel');
    this.title.icon = icon;
    this.title.caption = 'GPU snapshot';
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'GPU snapshot');
    model.onChange(() => this.render());
    this.render();
  }

  private last = '';

  render(): void {
    const m = this.model;
    const s = m.status;
    const now = Date.now();
    const key = JSON.stringify([s, m.error, m.busy, m.gone, m.restoring]);
    if (key === this.last) {
      // between polls only the countdown and the one-line summary move
      this.node.querySelectorAll<HTMLElement>('[data-countdown]').forEach(el => {
        el.textContent = formatCountdown(el.dataset.countdown || null, now);
      });
      const line = this.node.querySelector('.jp-gpusnap-line');
      if (line) {
        line.textContent = lineOf(m, now);
      }
      const idle = this.node.querySelector('.jp-gpusnap-idle-for');
      if (idle && s) {
        idle.textContent = formatDuration(idleSeconds(s, now) ?? 0);
      }
      return;
    }
    this.last = key;
    // a rebuild keeps the reader's choice and keyboard focus
    const focused = (document.activeElement as HTMLElement | null)?.id;
    const chosen = (this.node.querySelector('#jp-gpusnap-keep-for') as HTMLSelectElement | null)?.value;
    const children: HTMLElement[] = [h('h2', {}, 'GPU snapshot')];
    children.push(h('p', { class: 'jp-gpusnap-line', 'aria-live': 'polite' }, lineOf(m, now)));
    if (m.error) {
      children.push(h('p', { class: 'jp-gpusnap-error', role: 'alert' }, m.error));
    }
    if (m.gone) {
      children.push(this.goneBox(s));
    }
    if (s) {
      children.push(this.summary(s, now), this.signals(s));
      if (!m.gone) {
        children.push(this.actions(s));
      }
      children.push(this.history(s, now));
    }
    this.node.replaceChildren(...children);
    const select = this.node.querySelector('#jp-gpusnap-keep-for') as HTMLSelectElement | null;
    if (select && chosen && Array.from(select.options).some(o => o.value === chosen)) {
      select.value = chosen;
    }
    if (focused && this.node.querySelector(`#${focused}`)) {
      (this.node.querySelector(`#${focused}`) as HTMLElement).focus();
    }
  }

  /** The server is not running: what happened, and the way back from this tab. */
  private goneBox(s: IStatus | null): HTMLElement {
    const m = this.model;
    const box = h('section', { class: 'jp-gpusnap-gone', 'aria-label': 'Server not running' });
    box.append(h('p', {}, goneText(s, Date.now())));
    const restore = h(
      'button',
      { type: 'button', id: 'jp-gpusnap-restore', class: 'jp-Button jp-mod-styled jp-mod-accept' },
      m.restoring ? 'Restoring…' : restoreLabel(s)
    ) as HTMLButtonElement;
    restore.disabled = m.restoring;
    restore.addEventListener('click', () => void m.restore());
    box.append(restore);
    return box;
  }

  private summary(s: IStatus, now: number): HTMLElement {
    const rows: Array<[string, string | HTMLElement]> = [['State', stateWords(s, now)]];
    rows.push(['Rule', `${s.rule || 'default'}${s.idle_window ? `: suspended after ${formatDuration(s.idle_window)} idle` : ''}`]);
    const idle = idleSeconds(s, now);
    if (idle !== null && !['suspending', 'suspended', 'restoring'].includes(s.state)) {
      rows.push(['Idle for', h('span', { class: 'jp-gpusnap-idle-for' }, formatDuration(idle))]);
    }
    const kept = !!s.keep_until && Date.parse(s.keep_until) > now;
    if (s.suspend_at && !s.exempt && !kept) {
      const cd = h('span', { 'data-countdown': s.suspend_at, class: 'jp-gpusnap-countdown' }, formatCountdown(s.suspend_at, now));
      rows.push(['Suspends in', h('span', {}, cd, ` (at ${formatClock(s.suspend_at, now)})`)]);
    }
    if (s.park_at) {
      rows.push(['GPU parked at', formatClock(s.park_at, now)]);
    }
    const gpu = gpuMemoryLine(s, now);
    if (gpu) {
      rows.push(['GPU memory', gpu]);
    }
    if (s.keep_until && Date.parse(s.keep_until) > now) {
      rows.push(['Kept running until', s.exempt ? 'always (exempt)' : formatClock(s.keep_until, now)]);
    }
    if (s.restored_at) {
      rows.push(['Restored at', formatClock(s.restored_at, now)]);
    }
    if (s.failure) {
      rows.push(['Last failure', s.failure]);
    }
    return table('Where this server stands', rows, 'jp-gpusnap-summary');
  }

  private signals(s: IStatus): HTMLElement {
    const g = s.signals || {};
    const pct = (v: any) => (typeof v === 'number' ? `${v.toFixed(0)} %` : '—');
    return table(
      'What the service sees',
      [
        ['GPU', `${pct(g.gpu_percent)}${g.gpu_memory_bytes ? `, ${formatBytes(g.gpu_memory_bytes)} held` : ''}`],
        ['CPU', pct(g.cpu_percent)],
        ['Kernels', g.kernels === null || g.kernels === undefined ? '—' : `${g.kernels} (${g.kernels_busy || 0} busy)`],
        ['Terminals', g.terminals === null || g.terminals === undefined ? '—' : String(g.terminals)],
        ['Last active', s.last_active ? formatClock(s.last_active, Date.now()) : '—'],
        ['Last used here', s.last_interaction ? formatClock(s.last_interaction, Date.now()) : '—']
      ],
      'jp-gpusnap-signals'
    );
  }

  private actions(s: IStatus): HTMLElement {
    const box = h('section', { class: 'jp-gpusnap-actions', 'aria-label': 'Actions' });
    const choices = keepChoices(s.max_keep_running);
    const canAct = s.running && !['suspending', 'suspended', 'restoring'].includes(s.state);
    if (choices.length && !s.exempt) {
      const select = h('select', { id: 'jp-gpusnap-keep-for', class: 'jp-mod-styled' }) as HTMLSelectElement;
      choices.forEach(c => select.append(h('option', { value: String(c.seconds) }, c.label)));
      select.value = String(defaultKeep(choices));
      const keep = h('button', { type: 'button', id: 'jp-gpusnap-keep', class: 'jp-Button jp-mod-styled jp-mod-accept jp-gpusnap-keep' }, 'Keep running');
      keep.addEventListener('click', () => void this.model.act('keep', { seconds: Number(select.value) }));
      (keep as HTMLButtonElement).disabled = this.model.busy || !canAct;
      box.append(h('label', { for: 'jp-gpusnap-keep-for' }, 'Keep running for…'), h('div', { class: 'jp-gpusnap-row' }, select, keep));
    }
    const suspend = h('button', { type: 'button', id: 'jp-gpusnap-suspend', class: 'jp-Button jp-mod-styled jp-mod-warn jp-gpusnap-suspend' }, 'Suspend now');
    (suspend as HTMLButtonElement).disabled = this.model.busy || !canAct;
    suspend.addEventListener('click', async () => {
      const answer = await showDialog({
        title: 'Suspend this server now?',
        body: 'Your kernels are saved and the GPU goes back to the pool. The server comes back when you start it again.',
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Suspend' })]
      });
      if (answer.button.accept) {
        await this.model.act('suspend');
      }
    });
    box.append(suspend);
    return box;
  }

  private history(s: IStatus, now: number): HTMLElement {
    const rows = history(s, now);
    const t = h('table', { class: 'jp-gpusnap-history' }, h('caption', {}, 'Suspensions and restores'));
    t.append(h('tr', {}, ...['When', 'What', 'Size', 'Restore took'].map(c => h('th', { scope: 'col' }, c))));
    rows.forEach(r => t.append(h('tr', {}, h('td', {}, r.time), h('td', {}, r.what), h('td', {}, r.size), h('td', {}, r.took))));
    if (!rows.length) {
      t.append(h('tr', {}, h('td', { colspan: '4' }, 'None yet.')));
    }
    return t;
  }
}

/** The one-line summary (status bar and panel). */
function lineOf(m: Model, now: number): string {
  if (m.restoring) {
    return 'GPU snapshot: restoring your server…';
  }
  if (m.gone && (!m.status || m.status.running)) {
    return 'GPU snapshot: server not running';
  }
  if (m.error && !m.status) {
    return 'GPU snapshot: unavailable';
  }
  return statusLine(m.status, now);
}

function goneText(s: IStatus | null, now: number): string {
  if (s && s.state === 'suspended' && s.action !== 'stop') {
    return `Your server was suspended at ${formatClock(s.state_since, now)} to free the GPU; your kernels are saved. Restore it to carry on here: this notebook reconnects to the same kernel.`;
  }
  if (s && s.state === 'suspending') {
    return 'Your server is being suspended to free the GPU; your kernels are being saved.';
  }
  if (s && s.state === 'restoring') {
    return 'Your server is being restored from its snapshot…';
  }
  return 'Your server is not running. Start it again to carry on here (kernels that were not saved start afresh).';
}

function restoreLabel(s: IStatus | null): string {
  return s && ['suspended', 'suspending', 'restoring'].includes(s.state) && s.action !== 'stop' ? 'Restore' : 'Start';
}

/** Reconnect every open notebook and console to its kernel (the same kernel, restored). */
async function reconnect(app: JupyterFrontEnd): Promise<void> {
  const sm = app.serviceManager;
  await Promise.all([sm.kernels.refreshRunning(), sm.sessions.refreshRunning()]).catch(() => undefined);
  const waits: Promise<void>[] = [];
  for (const widget of app.shell.widgets('main')) {
    const w = widget as any;
    const kernel = (w.sessionContext ?? w.context?.sessionContext)?.session?.kernel;
    if (kernel && !kernel.isDisposed && kernel.connectionStatus !== 'connected') {
      waits.push(kernel.reconnect().catch(() => undefined));
    }
  }
  await Promise.all(waits);
}

/** Seconds the lost-connection dialog waits for a suspension under way to be recorded. */
const SUSPENDING_WAITS = 30;

/** In place of JupyterLab's "Server unavailable… Restart?": say what happened; restore here. */
function connectionLost(app: JupyterFrontEnd, model: Model): IConnectionLost {
  let showing = false;
  return async () => {
    if (showing || model.restoring) {
      return;
    }
    showing = true;
    try {
      await model.refresh();
      if (!model.gone) {
        return; // a passing network error: the server answers
      }
      // the server stops before the service records the suspension as done: wait for that
      // (seconds), so that the dialog says "suspended at …" rather than "being suspended"
      for (let i = 0; i < SUSPENDING_WAITS && model.status?.state === 'suspending'; i++) {
        await new Promise(resolve => setTimeout(resolve, 1000));
        await model.refresh();
      }
      const s = model.status;
      const saved = !!s && ['suspended', 'suspending', 'restoring'].includes(s.state) && s.action !== 'stop';
      const result = await showDialog({
        title: saved ? 'Your server is suspended' : 'Your server is not running',
        body: goneText(s, Date.now()),
        buttons: [Dialog.cancelButton({ label: 'Not now' }), Dialog.okButton({ label: restoreLabel(s) })]
      });
      if (result.button.accept) {
        await model.restore();
      }
    } finally {
      showing = false;
    }
  };
}

function table(caption: string, rows: Array<[string, string | HTMLElement]>, cls: string): HTMLElement {
  const t = h('table', { class: cls }, h('caption', {}, caption));
  rows.forEach(([k, v]) => t.append(h('tr', {}, h('th', { scope: 'row' }, k), h('td', {}, v))));
  return t;
}

const model = new Model();

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyterhub-gpusnap:plugin',
  description: 'Shows whether this server is idle and when it will be suspended; keep it running or suspend it now.',
  autoStart: true,
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, statusBar: IStatusBar | null) => {
    model.onBack = () => reconnect(app);
    const panel = new Panel(model);
    app.shell.add(panel, 'right', { rank: 900 });
    app.commands.addCommand('gpusnap:open', {
      label: 'Show GPU snapshot status',
      execute: () => app.shell.activateById(PANEL_ID)
    });
    if (statusBar) {
      statusBar.registerStatusItem('jupyterhub-gpusnap:status', {
        item: new StatusItem(model, () => void app.commands.execute('gpusnap:open')),
        align: 'left',
        rank: 1000
      });
    }
    void model.refresh();
    setInterval(() => void model.refresh(), POLL_MS);
    setInterval(() => void model.refreshUnpark(), UNPARK_POLL_MS);
    // the countdown moves every second between polls
    setInterval(() => model.emit(), 1000);
    const reporter = new InteractionReporter(
      () => void model.reportInteraction(),
      (f, ms) => void setTimeout(f, ms)
    );
    const listener = (ev: Event) => {
      if (countsAsInteraction(ev.type, ev.isTrusted, document.visibilityState)) {
        reporter.seen(Date.now());
      }
    };
    INTERACTION_EVENTS.forEach(type => document.addEventListener(type, listener, { capture: true, passive: true }));
  }
};

/** Replaces @jupyterlab/hub-extension:connectionlost (disabled in package.json). */
const connectionLostPlugin: JupyterFrontEndPlugin<IConnectionLost> = {
  id: 'jupyterhub-gpusnap:connectionlost',
  description: 'Says that the server was suspended (kernels saved) and restores it in this tab.',
  autoStart: true,
  provides: IConnectionLost,
  activate: (app: JupyterFrontEnd): IConnectionLost => connectionLost(app, model)
};

export default [plugin, connectionLostPlugin];
