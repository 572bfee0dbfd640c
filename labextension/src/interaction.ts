/**
 * What counts as the user using this tab, and how often it is reported to the service.
 * No JupyterLab imports, so `npm test` runs it under plain node.
 *
 * Only a person makes these events: keys, pointer presses, wheel and touch scrolling. Scroll
 * events are left out on purpose: output that scrolls itself in an unattended tab fires them.
 * An event counts only when the browser made it (isTrusted: not dispatched by a script) and the
 * tab is visible, so a forgotten tab in the background never keeps a GPU.
 */

/** The DOM events listened to (on the document, in the capture phase). */
export const INTERACTION_EVENTS = ['keydown', 'pointerdown', 'wheel', 'touchstart'];

/** At most one report per this many milliseconds (the service ticks once a minute). */
export const REPORT_EVERY_MS = 30000;

export function countsAsInteraction(type: string, isTrusted: boolean, visibility: string): boolean {
  return isTrusted && visibility === 'visible' && INTERACTION_EVENTS.includes(type);
}

/**
 * Throttled reports: the first interaction is sent at once; later ones within REPORT_EVERY_MS
 * of a report are folded into one report at the end of that period, so the service learns of
 * the last interaction at most REPORT_EVERY_MS late, and of a burst only twice.
 */
export class InteractionReporter {
  private lastSent = -Infinity;
  private pending = false;

  constructor(
    private send: () => void,
    private schedule: (f: () => void, ms: number) => void,
    private everyMs = REPORT_EVERY_MS
  ) {}

  /** An interaction at `now` (ms). */
  seen(now: number): void {
    if (this.pending) {
      return;
    }
    const wait = this.lastSent + this.everyMs - now;
    if (wait <= 0) {
      this.lastSent = now;
      this.send();
      return;
    }
    this.pending = true;
    this.schedule(() => {
      this.pending = false;
      this.lastSent = this.lastSent + this.everyMs;
      this.send();
    }, wait);
  }
}
