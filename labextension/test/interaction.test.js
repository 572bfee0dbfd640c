// What counts as the user using the tab, and how often it is reported.
const test = require('node:test');
const assert = require('node:assert/strict');
const i = require('../lib/test-build/interaction.js');

test('only trusted key, click, wheel and touch events in a visible tab count', () => {
  assert.equal(i.countsAsInteraction('keydown', true, 'visible'), true);
  assert.equal(i.countsAsInteraction('pointerdown', true, 'visible'), true);
  assert.equal(i.countsAsInteraction('wheel', true, 'visible'), true);
  assert.equal(i.countsAsInteraction('keydown', false, 'visible'), false); // dispatched by a script
  assert.equal(i.countsAsInteraction('keydown', true, 'hidden'), false); // a tab in the background
  assert.equal(i.countsAsInteraction('scroll', true, 'visible'), false); // output scrolls by itself
  assert.equal(i.countsAsInteraction('mousemove', true, 'visible'), false);
});

test('reports are throttled: the first at once, a burst folded into one at the end of the period', () => {
  const sent = [];
  const timers = [];
  let now = 0;
  const r = new i.InteractionReporter(() => sent.push(now), (f, ms) => timers.push({ f, at: now + ms }), 30000);
  r.seen(0);
  assert.deepEqual(sent, [0]);
  now = 1000;
  r.seen(now);
  now = 5000;
  r.seen(now);
  assert.deepEqual(sent, [0]); // folded
  assert.equal(timers.length, 1);
  assert.equal(timers[0].at, 30000);
  now = 30000;
  timers[0].f();
  assert.deepEqual(sent, [0, 30000]);
  now = 40000;
  r.seen(now); // within 30 s of the last report: waits for the end of that period
  assert.equal(timers.length, 2);
  assert.equal(timers[1].at, 60000);
  now = 100000;
  timers[1].f();
  r.seen(130000); // long after: at once
  assert.deepEqual(sent, [0, 30000, 100000, 100000]);
});
