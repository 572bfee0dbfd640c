/**
 * The gpusnap status-bar item and side panel: where this server stands (active, idle and when it
 * will be suspended, parked, restored from a snapshot), what the service sees, and two actions:
 * keep running for a while, or suspend now. Everything goes through the server extension's
 * /gpusnap/* handlers, whose polling does not count as activity.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import {
  formatBytes,
  formatClock,
  formatCountdown,
  formatDuration,
  gpuMemoryLine,
  history,
  IStatus,
  keepChoices,
  statusLine
} from './format';

const POLL_MS = 10000;
/** While parked, how often the panel asks the server extension (not the service) whether a
 * cell brought the GPU memory back: "resuming…" lasts about as long as the driver's restore. */
const UNPARK_POLL_MS = 1000;
const PANEL_ID = 'gpusnap-panel';

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
      throw new Error(data.message || `${resp.status} ${resp.statusText}`);
    }
    return data;
  }

  async refresh(): Promise<void> {
    try {
      this.status = await this.request('status');
      this.error = null;
    } catch (e) {
      this.error = (e as Error).message;
    }
    this.emit();
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
    const text = m.error && !m.status ? 'GPU snapshot: unavailable' : statusLine(m.status, Date.now());
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
    const key = JSON.stringify([s, m.error, m.busy]);
    if (key === this.last) {
      // between polls only the countdown and the one-line summary move
      this.node.querySelectorAll<HTMLElement>('[data-countdown]').forEach(el => {
        el.textContent = formatCountdown(el.dataset.countdown || null, now);
      });
      const line = this.node.querySelector('.jp-gpusnap-line');
      if (line) {
        line.textContent = statusLine(s, now);
      }
      return;
    }
    this.last = key;
    // a rebuild keeps the reader's choice and keyboard focus
    const focused = (document.activeElement as HTMLElement | null)?.id;
    const chosen = (this.node.querySelector('#jp-gpusnap-keep-for') as HTMLSelectElement | null)?.value;
    const children: HTMLElement[] = [h('h2', {}, 'GPU snapshot')];
    children.push(h('p', { class: 'jp-gpusnap-line', 'aria-live': 'polite' }, statusLine(s, now)));
    if (m.error) {
      children.push(h('p', { class: 'jp-gpusnap-error', role: 'alert' }, m.error));
    }
    if (s) {
      children.push(this.summary(s, now), this.signals(s), this.actions(s), this.history(s, now));
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

  private summary(s: IStatus, now: number): HTMLElement {
    const rows: Array<[string, string | HTMLElement]> = [['State', s.state + (s.reason ? ` — ${s.reason}` : '')]];
    rows.push(['Rule', `${s.rule || 'default'}${s.idle_window ? `: suspended after ${formatDuration(s.idle_window)} idle` : ''}`]);
    if (s.idle_seconds !== null) {
      rows.push(['Idle for', formatDuration(s.idle_seconds)]);
    }
    if (s.suspend_at && !s.exempt) {
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
        ['Last active', s.last_active ? formatClock(s.last_active, Date.now()) : '—']
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

function table(caption: string, rows: Array<[string, string | HTMLElement]>, cls: string): HTMLElement {
  const t = h('table', { class: cls }, h('caption', {}, caption));
  rows.forEach(([k, v]) => t.append(h('tr', {}, h('th', { scope: 'row' }, k), h('td', {}, v))));
  return t;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyterhub-gpusnap:plugin',
  description: 'Shows whether this server is idle and when it will be suspended; keep it running or suspend it now.',
  autoStart: true,
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, statusBar: IStatusBar | null) => {
    const model = new Model();
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
  }
};

export default plugin;
