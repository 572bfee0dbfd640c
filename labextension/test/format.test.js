// The status bar's words and the panel's numbers, from the pure functions in src/format.ts.
const test = require('node:test');
const assert = require('node:assert/strict');
const f = require('../lib/test-build/format.js');

const NOW = Date.parse('2026-11-22T15:28:00Z');
const TZ = 'UTC';

function status(extra) {
  return {
    server: 'alice/', user: 'alice', name: '', state: 'active', state_since: null, running: true,
    rule: 'default', reason: null, last_active: null, idle_seconds: 0, warn_at: null, suspend_at: null,
    park_at: null, keep_until: null, exempt: false, max_keep_running: 28800, idle_window: 3600,
    restored_at: null, checkpoint_id: null, failure: null, signals: {}, events: [], ...extra
  };
}

test('durations read like people talk', () => {
  assert.equal(f.formatDuration(45), '45 s');
  assert.equal(f.formatDuration(12 * 60 + 5), '12 min');
  assert.equal(f.formatDuration(3600 + 5 * 60), '1 h 05 min');
  assert.equal(f.formatDuration(7200), '2 h');
  assert.equal(f.formatDuration(3 * 86400 + 3600), '3 d 1 h');
  assert.equal(f.formatDuration(-5), '0 s');
});

test('the countdown never goes negative', () => {
  assert.equal(f.formatCountdown('2026-11-22T15:40:00Z', NOW), '12:00');
  assert.equal(f.formatCountdown('2026-11-22T16:40:09Z', NOW), '1:12:09');
  assert.equal(f.formatCountdown('2026-11-22T15:00:00Z', NOW), '0:00');
  assert.equal(f.formatCountdown(null, NOW), '');
});

test('clock times name the day when it is not today', () => {
  assert.equal(f.formatClock('2026-11-22T09:12:00Z', NOW, TZ), '09:12');
  assert.equal(f.formatClock('2026-11-21T09:12:00Z', NOW, TZ), 'Sat 09:12');
});

test('sizes', () => {
  assert.equal(f.formatBytes(2.5 * 1024 ** 3), '2.5 GiB');
  assert.equal(f.formatBytes(340 * 1024 ** 2), '340 MiB');
  assert.equal(f.formatBytes(512), '512 B');
  assert.equal(f.formatBytes(null), '—');
});

test('status bar lines for each state', () => {
  assert.equal(f.statusLine(status({}), NOW, TZ), 'GPU snapshot: active');
  assert.equal(
    f.statusLine(status({ state: 'idle', idle_seconds: 720, suspend_at: '2026-11-22T15:40:00Z' }), NOW, TZ),
    'idle 12 min — suspends at 15:40'
  );
  assert.equal(
    f.statusLine(status({ state: 'warned', idle_seconds: 720, suspend_at: '2026-11-22T15:40:00Z', keep_until: '2026-11-22T18:00:00Z' }), NOW, TZ),
    'idle 12 min — kept running until 18:00'
  );
  assert.equal(
    f.statusLine(status({ state: 'parked', state_since: '2026-11-22T14:02:00Z' }), NOW, TZ),
    'parked: GPU memory in host RAM since 14:02'
  );
  const restored = status({
    restored_at: '2026-11-22T15:20:00Z',
    events: [
      { id: 1, time: '2026-11-22T09:12:00Z', key: 'alice/', kind: 'suspend', detail: {} },
      { id: 2, time: '2026-11-22T15:20:00Z', key: 'alice/', kind: 'restore', detail: {} }
    ]
  });
  assert.equal(f.statusLine(restored, NOW, TZ), 'restored from snapshot of 09:12');
  // right after a restore the server is idle, and the line still says where it came from
  assert.equal(f.statusLine({ ...restored, state: 'idle', idle_seconds: 60 }, NOW, TZ), 'restored from snapshot of 09:12');
  // later on, the idle countdown is back
  const later = NOW + 3600 * 1000;
  assert.equal(
    f.statusLine({ ...restored, state: 'idle', idle_seconds: 600, suspend_at: '2026-11-22T16:40:00Z' }, later, TZ),
    'idle 10 min — suspends at 16:40'
  );
  assert.equal(f.statusLine(status({ exempt: true }), NOW, TZ), 'GPU snapshot: exempt');
  assert.equal(f.statusLine(null, NOW, TZ), 'GPU snapshot: not watched yet');
});

test('keep-running choices stay within the maximum', () => {
  const choices = f.keepChoices(7200);
  assert.deepEqual(choices.map(c => c.seconds), [1800, 3600, 7200]);
  assert.match(choices[choices.length - 1].label, /maximum/);
  assert.ok(f.keepChoices(28800).every(c => c.seconds <= 28800));
  assert.deepEqual(f.keepChoices(0), []);
});

test('history shows restores with size and duration, newest first', () => {
  const rows = f.history(
    status({
      events: [
        { id: 1, time: '2026-11-22T09:12:00Z', key: 'alice/', kind: 'suspend', detail: { image_bytes: 2 * 1024 ** 3, gpu_bytes: 1024 ** 3 } },
        { id: 2, time: '2026-11-22T09:13:00Z', key: 'alice/', kind: 'state', detail: {} },
        { id: 3, time: '2026-11-22T15:00:00Z', key: 'alice/', kind: 'restore', detail: { image_bytes: 2 * 1024 ** 3, restore_s: 4.25 } }
      ]
    }),
    NOW,
    TZ
  );
  assert.equal(rows.length, 2);
  assert.deepEqual(rows[0], { time: '15:00', what: 'restored', size: '2.0 GiB', took: '4.3 s' });
  assert.deepEqual(rows[1], { time: '09:12', what: 'suspended', size: '2.0 GiB (GPU 1.0 GiB)', took: '' });
});

test('a parked server says "resuming…" while a cell brings its GPU memory back', () => {
  const parked = status({ state: 'parked', state_since: '2026-11-22T14:02:00Z' });
  const idle = { watching: true, resuming: false, resuming_since: null, resuming_kernels: [], last_unpark: null };
  // parked, nothing running: the parked line and where the memory is
  assert.equal(f.statusLine({ ...parked, autounpark: idle }, NOW, TZ), 'parked: GPU memory in host RAM since 14:02');
  assert.equal(
    f.gpuMemoryLine({ ...parked, autounpark: idle }, NOW, TZ),
    'in host RAM since 14:02 (back when you run a cell)'
  );
  // a cell started: the extension is restoring the kernel's GPU memory
  const resuming = {
    ...parked,
    autounpark: { ...idle, resuming: true, resuming_since: '2026-11-22T15:27:58Z', resuming_kernels: ['k1'] }
  };
  assert.equal(f.statusLine(resuming, NOW, TZ), 'resuming… GPU memory coming back from host RAM');
  assert.equal(f.gpuMemoryLine(resuming, NOW, TZ), 'resuming… coming back from host RAM since 15:27');
  // done, before the service has looked again (it still says "parked")
  const back = { ...parked, autounpark: { ...idle, last_unpark: { kernel: 'k1', seconds: 2.1, at: '2026-11-22T15:28:00Z' } } };
  assert.equal(f.unparkedAt(back), '2026-11-22T15:28:00Z');
  assert.equal(f.statusLine(back, NOW, TZ), 'resumed: GPU memory back on the GPU since 15:28');
  assert.equal(f.gpuMemoryLine(back, NOW, TZ), 'back on the GPU since 15:28');
  // an unpark from before this parking does not count
  const older = { ...parked, autounpark: { ...idle, last_unpark: { kernel: 'k1', seconds: 2.1, at: '2026-11-22T13:00:00Z' } } };
  assert.equal(f.unparkedAt(older), null);
  assert.equal(f.statusLine(older, NOW, TZ), 'parked: GPU memory in host RAM since 14:02');
  // resuming wins over every other line; an active server with nothing parked says nothing of it
  assert.equal(f.statusLine({ ...resuming, state: 'warned' }, NOW, TZ), 'resuming… GPU memory coming back from host RAM');
  assert.equal(f.gpuMemoryLine(status({ autounpark: idle }), NOW, TZ), null);
  // a server extension without the field (older) still renders
  assert.equal(f.statusLine(parked, NOW, TZ), 'parked: GPU memory in host RAM since 14:02');
});

test('the state row says where the server stands in words, with times that agree with "Idle for"', () => {
  const idle = status({ state: 'idle', idle_since: '2026-11-22T15:16:00Z', idle_seconds: 600, reason: 'kernel/terminal activity' });
  assert.equal(f.stateWords(idle, NOW, TZ), 'idle since 15:16');
  assert.equal(f.idleSeconds(idle, NOW), 12 * 60); // moves with the clock, not frozen at the last poll
  assert.equal(
    f.stateWords(status({ state: 'suspended', state_since: '2026-11-22T11:50:00Z', action: 'suspend' }), NOW, TZ),
    'suspended at 11:50 to free the GPU; your kernels are saved'
  );
  assert.equal(
    f.stateWords(status({ state: 'warned', idle_since: '2026-11-22T15:00:00Z', keep_until: '2026-11-22T18:00:00Z' }), NOW, TZ),
    'idle since 15:00 — kept running until 18:00'
  );
  assert.equal(
    f.statusLine(status({ state: 'suspended', state_since: '2026-11-22T11:50:00Z' }), NOW, TZ),
    'suspended at 11:50 — your kernels are saved'
  );
});

test('the keep choice selected at first is 1 h, as on the service pages', () => {
  assert.equal(f.defaultKeep(f.keepChoices(28800)), 3600);
  assert.equal(f.defaultKeep(f.keepChoices(7200)), 3600);
  assert.equal(f.defaultKeep(f.keepChoices(1200)), 1200); // only the maximum
  assert.equal(f.defaultKeep(f.keepChoices(0)), null);
});

test('a tab whose server is suspended asks the service, and the server only now and then', () => {
  const suspended = status({ state: 'suspended', running: false });
  const asked = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12].filter(n => f.probeServer(suspended, n));
  assert.deepEqual(asked, [6, 12]);
  assert.equal(f.probeServer(null, 1), true); // the service cannot say: ask the server
  assert.equal(f.probeServer(status({ state: 'active', running: true }), 1), true); // back
  assert.equal(f.probeServer(status({ state: 'restoring', running: false }), 1), true);
});
