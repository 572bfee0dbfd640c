/**
 * Pure formatting of a server's gpusnap status: what the status bar and the panel say.
 * No JupyterLab imports, so `npm test` runs it under plain node.
 */

export interface IEvent {
  id: number;
  time: string;
  key: string;
  kind: string;
  detail: { [key: string]: any } | null;
}

/**
 * The server extension's automatic unpark (GET /gpusnap/autounpark, and `autounpark` in the
 * status): a parked kernel that runs a cell gets its GPU memory back by itself.
 */
export interface IAutoUnpark {
  watching: boolean;
  resuming: boolean;
  resuming_since: string | null;
  resuming_kernels: string[];
  last_unpark: { kernel: string; seconds: number; at: string | null } | null;
}

/** The service's status model (GET api/servers/{user}/{name}), as relayed by /gpusnap/status. */
export interface IStatus {
  server: string;
  user: string;
  name: string;
  state: string;
  state_since: string | null;
  running: boolean;
  rule: string | null;
  reason: string | null;
  last_active: string | null;
  idle_seconds: number | null;
  warn_at: string | null;
  suspend_at: string | null;
  park_at: string | null;
  keep_until: string | null;
  exempt: boolean;
  max_keep_running: number | null;
  idle_window: number | null;
  /** When the current idle period began (the later of the last activity and interaction). */
  idle_since?: string | null;
  /** What an idle server comes to: suspend (kernels saved), stop (kernels lost) or none. */
  action?: string;
  /** The user's last key, click or scroll in a visible Lab tab, as the service knows it. */
  last_interaction?: string | null;
  interaction_window?: number | null;
  restored_at: string | null;
  checkpoint_id: string | null;
  failure: string | null;
  signals: { [key: string]: any };
  events?: IEvent[];
  autounpark?: IAutoUnpark | null;
}

function ms(iso: string | null | undefined): number | null {
  if (!iso) {
    return null;
  }
  const t = Date.parse(iso);
  return isNaN(t) ? null : t;
}

/** "45 s", "12 min", "1 h 05 min", "2 d 3 h": a duration in seconds for people. */
export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  const m = Math.floor(s / 60);
  if (m < 60) {
    return `${m} min`;
  }
  const h = Math.floor(m / 60);
  if (h < 48) {
    const rest = m % 60;
    return rest ? `${h} h ${String(rest).padStart(2, '0')} min` : `${h} h`;
  }
  const d = Math.floor(h / 24);
  return h % 24 ? `${d} d ${h % 24} h` : `${d} d`;
}

/** A countdown "mm:ss" or "h:mm:ss" to a time, never negative. */
export function formatCountdown(targetIso: string | null, now: number): string {
  const t = ms(targetIso);
  if (t === null) {
    return '';
  }
  const s = Math.max(0, Math.round((t - now) / 1000));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const sec = String(s % 60).padStart(2, '0');
  return h ? `${h}:${String(m).padStart(2, '0')}:${sec}` : `${m}:${sec}`;
}

/** Local wall-clock time "15:40" (or "Mon 15:40" when not today). */
export function formatClock(iso: string | null, now: number, tz?: string): string {
  const t = ms(iso);
  if (t === null) {
    return '';
  }
  const opts: Intl.DateTimeFormatOptions = { hour: '2-digit', minute: '2-digit', hour12: false, timeZone: tz };
  const day = (x: number) => new Date(x).toLocaleDateString('en-CA', { timeZone: tz });
  const clock = new Date(t).toLocaleTimeString('en-GB', opts);
  if (day(t) === day(now)) {
    return clock;
  }
  const weekday = new Date(t).toLocaleDateString('en-GB', { weekday: 'short', timeZone: tz });
  return `${weekday} ${clock}`;
}

/** "2.5 GiB", "340 MiB", "12 KiB". */
export function formatBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || isNaN(n)) {
    return '—';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${v} B` : `${v < 10 ? v.toFixed(1) : Math.round(v)} ${units[i]}`;
}

/** The snapshot a restore came from: the newest suspend event before `restored_at`. */
export function snapshotTime(status: IStatus): string | null {
  const restored = ms(status.restored_at);
  if (restored === null) {
    return null;
  }
  const suspends = (status.events || [])
    .filter(e => e.kind === 'suspend' && (ms(e.time) ?? Infinity) <= restored)
    .sort((a, b) => (ms(b.time) ?? 0) - (ms(a.time) ?? 0));
  return suspends.length ? suspends[0].time : status.restored_at;
}

/**
 * When a parked server's GPU memory came back by itself (a cell ran), if that happened after it
 * was parked: the service still says "parked" until its next look at the server.
 */
export function unparkedAt(status: IStatus): string | null {
  const at = status.autounpark?.last_unpark?.at ?? null;
  const t = ms(at);
  const since = ms(status.state_since);
  if (t === null || (since !== null && t < since)) {
    return null;
  }
  return at;
}

/** Where the server's GPU memory is, while that is worth saying (the panel's "GPU memory" row). */
export function gpuMemoryLine(status: IStatus, now: number, tz?: string): string | null {
  const a = status.autounpark;
  if (a?.resuming) {
    return `resuming… coming back from host RAM since ${formatClock(a.resuming_since, now, tz)}`;
  }
  if (status.state !== 'parked') {
    return null;
  }
  const back = unparkedAt(status);
  if (back) {
    return `back on the GPU since ${formatClock(back, now, tz)}`;
  }
  return `in host RAM since ${formatClock(status.state_since, now, tz)} (back when you run a cell)`;
}

/** How long after a restore the status bar says so (then the usual idle countdown returns). */
export const RESTORED_FOR_MS = 15 * 60 * 1000;

/** The status bar's one line. */
export function statusLine(status: IStatus | null, now: number, tz?: string): string {
  if (!status) {
    return 'GPU snapshot: not watched yet';
  }
  if (status.autounpark?.resuming) {
    return 'resuming… GPU memory coming back from host RAM';
  }
  const keep = ms(status.keep_until);
  const idle = status.idle_seconds !== null ? formatDuration(status.idle_seconds) : '';
  const restored = ms(status.restored_at);
  if (
    restored !== null &&
    now - restored < RESTORED_FOR_MS &&
    (status.state === 'active' || status.state === 'idle') &&
    !status.exempt
  ) {
    return `restored from snapshot of ${formatClock(snapshotTime(status), now, tz)}`;
  }
  switch (status.state) {
    case 'exempt':
      return 'GPU snapshot: exempt';
    case 'parked': {
      const back = unparkedAt(status);
      if (back) {
        return `resumed: GPU memory back on the GPU since ${formatClock(back, now, tz)}`;
      }
      return `parked: GPU memory in host RAM since ${formatClock(status.state_since, now, tz)}`;
    }
    case 'suspending':
      return 'GPU snapshot: suspending… saving your kernels';
    case 'suspended':
      return `suspended at ${formatClock(status.state_since, now, tz)} — your kernels are saved`;
    case 'restoring':
      return 'GPU snapshot: restoring…';
    case 'failed':
      return 'GPU snapshot: failed (see panel)';
    case 'idle':
    case 'warned':
      if (keep !== null && keep > now && !status.exempt) {
        return `idle ${idle} — kept running until ${formatClock(status.keep_until, now, tz)}`;
      }
      if (status.suspend_at) {
        return `idle ${idle} — suspends at ${formatClock(status.suspend_at, now, tz)}`;
      }
      return `idle ${idle}`;
    default:
      if (status.exempt) {
        return 'GPU snapshot: exempt';
      }
      if (keep !== null && keep > now) {
        return `GPU snapshot: active — kept running until ${formatClock(status.keep_until, now, tz)}`;
      }
      return 'GPU snapshot: active';
  }
}

export interface IChoice {
  label: string;
  seconds: number;
}

/** Keep-running choices within the admin's maximum; the maximum itself is always the last one. */
export function keepChoices(maxSeconds: number | null | undefined): IChoice[] {
  const steps = [1800, 3600, 7200, 4 * 3600, 8 * 3600, 24 * 3600];
  if (!maxSeconds || maxSeconds <= 0) {
    return [];
  }
  const out = steps.filter(s => s < maxSeconds).map(s => ({ label: formatDuration(s), seconds: s }));
  out.push({ label: `${formatDuration(maxSeconds)} (the maximum)`, seconds: maxSeconds });
  return out;
}

/** The choice selected at first, here and on the service's pages: 1 h, or the maximum if shorter. */
export const DEFAULT_KEEP_SECONDS = 3600;

export function defaultKeep(choices: IChoice[]): number | null {
  if (!choices.length) {
    return null;
  }
  const fit = choices.filter(c => c.seconds <= DEFAULT_KEEP_SECONDS);
  return (fit.length ? fit[fit.length - 1] : choices[0]).seconds;
}

/** Seconds idle now: from idle_since, moving between polls; else the service's last count. */
export function idleSeconds(status: IStatus, now: number): number | null {
  const since = ms(status.idle_since);
  if (since !== null && ['idle', 'warned', 'parked'].includes(status.state)) {
    return Math.max(0, (now - since) / 1000);
  }
  return status.idle_seconds;
}

/** The panel's "State" row in plain words; its times never contradict "Idle for". */
export function stateWords(status: IStatus, now: number, tz?: string): string {
  const keep = ms(status.keep_until);
  const kept = keep !== null && keep > now;
  switch (status.state) {
    case 'active':
      if (status.exempt) {
        return 'active — exempt, never suspended';
      }
      if (kept) {
        return `active — kept running until ${formatClock(status.keep_until, now, tz)}`;
      }
      return status.reason ? `active — ${status.reason}` : 'active';
    case 'idle':
    case 'warned': {
      const since = formatClock(status.idle_since || status.last_active, now, tz);
      const warned = status.state === 'warned' ? '; you were warned' : '';
      return kept
        ? `idle since ${since} — kept running until ${formatClock(status.keep_until, now, tz)}`
        : `idle since ${since}${warned}`;
    }
    case 'parked':
      return `idle, GPU memory parked in host RAM since ${formatClock(status.state_since, now, tz)}`;
    case 'suspending':
      return 'suspending — saving your kernels to disk';
    case 'suspended':
      return status.action === 'stop'
        ? `stopped at ${formatClock(status.state_since, now, tz)} to free the GPU`
        : `suspended at ${formatClock(status.state_since, now, tz)} to free the GPU; your kernels are saved`;
    case 'restoring':
      return 'restoring from the snapshot…';
    case 'failed':
      return `suspension failed (${status.failure || status.reason || 'see the history'}); the server keeps running`;
    case 'exempt':
      return 'exempt — never suspended';
    default:
      return status.state;
  }
}

/** One row of the history table: suspensions and restores, newest first. */
export interface IHistoryRow {
  time: string;
  what: string;
  size: string;
  took: string;
}

const HISTORY_KINDS: { [kind: string]: string } = {
  suspend: 'suspended',
  suspend_failed: 'suspend failed',
  restore: 'restored',
  restore_failed: 'restore failed',
  park: 'parked',
  unpark: 'unparked',
  stop: 'stopped'
};

export function history(status: IStatus | null, now: number, tz?: string, limit = 8): IHistoryRow[] {
  const events = (status?.events || []).filter(e => e.kind in HISTORY_KINDS);
  events.sort((a, b) => (ms(b.time) ?? 0) - (ms(a.time) ?? 0));
  return events.slice(0, limit).map(e => {
    const d = e.detail || {};
    const image = d.image_bytes ?? d.bytes;
    return {
      time: formatClock(e.time, now, tz),
      what: HISTORY_KINDS[e.kind] + (d.error ? `: ${d.error}` : ''),
      size: (image ? formatBytes(image) : '') + (d.gpu_bytes ? ` (GPU ${formatBytes(d.gpu_bytes)})` : ''),
      took: typeof d.restore_s === 'number' ? `${d.restore_s.toFixed(1)} s` : ''
    };
  });
}

/** Polls a tab whose server is gone makes of the server itself, one in this many. */
export const GONE_PROBE_EVERY = 6;

/**
 * Whether a tab whose server is gone should ask the server itself on this poll: when the
 * service cannot say (null), when the service sees it running or no longer suspended, and
 * otherwise one poll in GONE_PROBE_EVERY (a restore from another tab shows within a minute).
 * Every other poll asks the service only, so a forgotten tab does not fill the Hub's log
 * with a 424 every few seconds.
 */
export function probeServer(service: IStatus | null, poll: number): boolean {
  if (!service || service.running) {
    return true;
  }
  if (!['suspended', 'suspending'].includes(service.state)) {
    return true;
  }
  return poll % GONE_PROBE_EVERY === 0;
}
