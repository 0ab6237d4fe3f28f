//! The inbox property and the example-based checks.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox_traits::{uuid::Uuid, Error};
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

use super::harness::{InboxHarness, InboxStore, InboxTx, Mark};
use super::scenario::{inbox_scenario, DeliveryEnd, InboxScenario, InboxStep, TxEnd, CONSUMERS};
use crate::property::runtime;

/// The property's cases are `PROPTEST_CASES` divided by this (at least 16): each case is a
/// scenario of up to 40 steps on a fresh inbox of a real database.
pub const CASE_DIVISOR: u32 = 50;

/// How long a race waits for the second transaction to block before ending the first anyway.
const RACE_PATIENCE: Duration = Duration::from_secs(5);

type Key = (usize, usize);

/// What the inbox must hold, step by step.
struct Model {
    ids: Vec<Uuid>,
    /// Committed marks and their age in hours.
    marks: HashMap<Key, u32>,
    /// Effects applied (committed), per message and consumer.
    effects: HashMap<Key, u32>,
    /// Delivered and not acknowledged: the broker redelivers these.
    pending: HashSet<Key>,
    /// Ever delivered.
    delivered: HashSet<Key>,
    /// Ever purged: a redelivery after the purge is new again (documented).
    purged: HashSet<Key>,
}

impl Model {
    fn new() -> Self {
        Self {
            ids: (0..super::scenario::MESSAGES)
                .map(|_| Uuid::new_v4())
                .collect(),
            marks: HashMap::new(),
            effects: HashMap::new(),
            pending: HashSet::new(),
            delivered: HashSet::new(),
            purged: HashSet::new(),
        }
    }

    fn key_of(&self, (consumer, id): &Mark, what: &str) -> Result<Key, String> {
        let c = CONSUMERS.iter().position(|name| name == consumer);
        let m = self.ids.iter().position(|known| known == id);
        match (c, m) {
            (Some(c), Some(m)) => Ok((c, m)),
            _ => Err(format!(
                "the store holds a {what} no delivery made: consumer {consumer:?}, message {id}"
            )),
        }
    }

    fn commit(&mut self, new: &[Key]) {
        for key in new {
            self.marks.insert(*key, 0);
            *self.effects.entry(*key).or_default() += 1;
        }
    }
}

fn err(context: &str) -> impl Fn(Error) -> String + '_ {
    move |e| format!("{context} failed: {e}")
}

/// Check that the store's marks and effects are the model's.
async fn verify(store: &dyn InboxStore, model: &Model) -> Result<(), String> {
    let mut marks = HashSet::new();
    for mark in store.marks().await.map_err(err("reading the marks"))? {
        let key = model.key_of(&mark, "mark")?;
        if !marks.insert(key) {
            return Err(format!("mark {mark:?} is stored twice"));
        }
    }
    let expected: HashSet<Key> = model.marks.keys().copied().collect();
    if marks != expected {
        let extra: Vec<_> = marks.difference(&expected).collect();
        let missing: Vec<_> = expected.difference(&marks).collect();
        return Err(format!(
            "the marks differ from the committed deliveries: marked but not committed \
             (consumer, message) {extra:?} (a rolled-back handler left its mark, or a purge \
             kept it); committed but not marked {missing:?} (lost, or purged wrongly)"
        ));
    }
    let mut effects: HashMap<Key, u32> = HashMap::new();
    for effect in store.effects().await.map_err(err("reading the effects"))? {
        *effects.entry(model.key_of(&effect, "effect")?).or_default() += 1;
    }
    if effects != model.effects {
        let mut diff: Vec<String> = effects
            .keys()
            .chain(model.effects.keys())
            .collect::<HashSet<_>>()
            .into_iter()
            .filter(|k| effects.get(k) != model.effects.get(k))
            .map(|k| {
                format!(
                    "(consumer {}, message {}): {} applied, {} expected",
                    k.0,
                    k.1,
                    effects.get(k).unwrap_or(&0),
                    model.effects.get(k).unwrap_or(&0)
                )
            })
            .collect();
        diff.sort();
        return Err(format!("the effects differ: {}", diff.join("; ")));
    }
    Ok(())
}

fn compare(step: &str, got: &[bool], expected: &[bool]) -> Result<(), String> {
    if got == expected {
        return Ok(());
    }
    Err(format!(
        "{step}: the inbox answered new = {got:?}, expected {expected:?} (new exactly when no \
         committed transaction of this consumer marked the id, first occurrence in the batch \
         only)"
    ))
}

async fn deliver(
    store: &dyn InboxStore,
    model: &mut Model,
    consumer: usize,
    messages: &[usize],
    end: DeliveryEnd,
) -> Result<(), String> {
    let name = CONSUMERS[consumer];
    let ids: Vec<Uuid> = messages.iter().map(|m| model.ids[*m]).collect();
    let mut seen = HashSet::new();
    let expected: Vec<bool> = messages
        .iter()
        .map(|m| seen.insert(*m) && !model.marks.contains_key(&(consumer, *m)))
        .collect();
    let mut tx = store.begin().await.map_err(err("begin"))?;
    let got = tx.record(name, &ids).await.map_err(err("record"))?;
    compare("delivery", &got, &expected)?;
    let mut new = Vec::new();
    for (m, is_new) in messages.iter().zip(&got) {
        if *is_new {
            tx.apply_effect(name, model.ids[*m])
                .await
                .map_err(err("apply_effect"))?;
            new.push((consumer, *m));
        }
    }
    let keys = messages.iter().map(|m| (consumer, *m));
    model.delivered.extend(keys.clone());
    match end {
        DeliveryEnd::Ack | DeliveryEnd::CrashAfterCommit => {
            tx.commit().await.map_err(err("commit"))?;
            model.commit(&new);
            if end == DeliveryEnd::Ack {
                keys.for_each(|k| {
                    model.pending.remove(&k);
                });
            } else {
                model.pending.extend(keys);
            }
        }
        DeliveryEnd::CrashBeforeCommit => {
            drop(tx);
            model.pending.extend(keys);
        }
        DeliveryEnd::HandlerFails => {
            tx.rollback().await.map_err(err("rollback"))?;
            model.pending.extend(keys);
        }
    }
    Ok(())
}

async fn race(
    store: &dyn InboxStore,
    model: &mut Model,
    consumer: usize,
    message: usize,
    first: TxEnd,
) -> Result<(), String> {
    let name = CONSUMERS[consumer];
    let id = model.ids[message];
    let key = (consumer, message);
    model.delivered.insert(key);
    let expected_a = !model.marks.contains_key(&key);
    let mut a = store.begin().await.map_err(err("begin (first)"))?;
    let got = a.record(name, &[id]).await.map_err(err("record (first)"))?;
    compare("race, first transaction", &got, &[expected_a])?;
    if expected_a {
        a.apply_effect(name, id)
            .await
            .map_err(err("apply_effect (first)"))?;
    }
    let mut b: Box<dyn InboxTx> = store.begin().await.map_err(err("begin (second)"))?;
    let second = tokio::spawn(async move {
        let got = b.record(CONSUMERS[consumer], &[id]).await;
        (b, got)
    });
    // Let the second block on the first's mark (or finish) before the first ends.
    let since = Instant::now();
    while !second.is_finished() && since.elapsed() < RACE_PATIENCE {
        match store.lock_waits().await.map_err(err("lock_waits"))? {
            Some(0) => tokio::task::yield_now().await,
            Some(_) => break,
            None => {
                for _ in 0..64 {
                    tokio::task::yield_now().await;
                }
                break;
            }
        }
    }
    if expected_a && second.is_finished() {
        // It answered without waiting for an undecided mark: whatever it said may be wrong.
        let (_, got) = second
            .await
            .map_err(|e| format!("the second record panicked: {e}"))?;
        return Err(format!(
            "race: while a first transaction held an uncommitted mark, a second delivery of the \
             same id answered at once ({got:?}) instead of waiting for the first to commit or \
             roll back"
        ));
    }
    match first {
        TxEnd::Commit => {
            a.commit().await.map_err(err("commit (first)"))?;
            if expected_a {
                model.commit(&[key]);
            }
        }
        TxEnd::Rollback => a.rollback().await.map_err(err("rollback (first)"))?,
    }
    let (mut b, got) = second
        .await
        .map_err(|e| format!("the second record panicked: {e}"))?;
    let got = got.map_err(err("record (second)"))?;
    let expected_b = !model.marks.contains_key(&key);
    compare(
        &format!("race, second transaction after the first's {first:?}"),
        &got,
        &[expected_b],
    )?;
    if expected_b {
        b.apply_effect(name, id)
            .await
            .map_err(err("apply_effect (second)"))?;
    }
    b.commit().await.map_err(err("commit (second)"))?;
    if expected_b {
        model.commit(&[key]);
    }
    model.pending.remove(&key);
    Ok(())
}

async fn purge(
    store: &dyn InboxStore,
    model: &mut Model,
    older_than_hours: u32,
    batch: u32,
) -> Result<(), String> {
    let older_than = Duration::from_secs(u64::from(older_than_hours) * 3600 - 1800);
    let eligible: HashSet<Key> = model
        .marks
        .iter()
        .filter(|(_, age)| **age >= older_than_hours)
        .map(|(k, _)| *k)
        .collect();
    let deleted = store.purge(older_than, batch).await.map_err(err("purge"))?;
    let expected = eligible.len().min(batch as usize) as u64;
    if deleted != expected {
        return Err(format!(
            "purge(older than {older_than:?}, batch {batch}) said it deleted {deleted} marks; \
             {} are that old, so it should delete {expected}",
            eligible.len()
        ));
    }
    let mut left = HashSet::new();
    for mark in store.marks().await.map_err(err("reading the marks"))? {
        left.insert(model.key_of(&mark, "mark")?);
    }
    let removed: HashSet<Key> = model
        .marks
        .keys()
        .filter(|k| !left.contains(k))
        .copied()
        .collect();
    if let Some(young) = removed.iter().find(|k| !eligible.contains(k)) {
        return Err(format!(
            "purge(older than {older_than:?}, batch {batch}) removed the mark of (consumer {}, \
             message {}), which is only {} hours old: its redelivery would be applied again",
            young.0, young.1, model.marks[young]
        ));
    }
    if removed.len() as u64 != deleted {
        return Err(format!(
            "purge(older than {older_than:?}, batch {batch}) said {deleted} but removed {} marks",
            removed.len()
        ));
    }
    for key in removed {
        model.marks.remove(&key);
        model.purged.insert(key);
    }
    Ok(())
}

/// Play `scenario` on `store` and check the model after every step and at the end.
pub(crate) async fn run_inbox_scenario(
    store: &dyn InboxStore,
    scenario: &InboxScenario,
) -> Result<(), String> {
    let concurrent = store.capabilities().concurrent_transactions;
    let mut model = Model::new();
    for (n, step) in scenario.steps.iter().enumerate() {
        let at = |reason: String| format!("step {} ({step:?}): {reason}", n + 1);
        match step {
            InboxStep::Deliver {
                consumer,
                messages,
                end,
            } => deliver(store, &mut model, *consumer, messages, *end).await,
            InboxStep::Race {
                consumer,
                message,
                first,
            } => {
                if concurrent {
                    race(store, &mut model, *consumer, *message, *first).await
                } else {
                    let end = match first {
                        TxEnd::Commit => DeliveryEnd::Ack,
                        TxEnd::Rollback => DeliveryEnd::HandlerFails,
                    };
                    deliver(store, &mut model, *consumer, &[*message], end).await
                }
            }
            InboxStep::Age { hours } => {
                let result = store
                    .age_marks(Duration::from_secs(u64::from(*hours) * 3600))
                    .await
                    .map_err(err("age_marks"));
                model.marks.values_mut().for_each(|age| *age += hours);
                result
            }
            InboxStep::Purge {
                older_than_hours,
                batch,
            } => purge(store, &mut model, *older_than_hours, *batch).await,
        }
        .map_err(at)?;
        verify(store, &model).await.map_err(at)?;
    }
    // The broker redelivers whatever was not acknowledged until it is.
    let mut pending: Vec<Key> = model.pending.iter().copied().collect();
    pending.sort_unstable();
    for (consumer, message) in pending {
        deliver(store, &mut model, consumer, &[message], DeliveryEnd::Ack)
            .await
            .map_err(|r| format!("redelivering the unacknowledged: {r}"))?;
    }
    verify(store, &model)
        .await
        .map_err(|r| format!("after redelivering the unacknowledged: {r}"))?;
    for key in &model.delivered {
        let applied = model.effects.get(key).copied().unwrap_or(0);
        if applied == 0 || (applied > 1 && !model.purged.contains(key)) {
            return Err(format!(
                "message {} was applied {applied} times for consumer {:?}: exactly once expected",
                key.1, CONSUMERS[key.0]
            ));
        }
    }
    Ok(())
}

/// Run the inbox property against `harness` with `config` (its cases already scaled, e.g. by
/// [`crate::property::reduced_cases`] with [`CASE_DIVISOR`]): every generated scenario on a
/// fresh inbox keeps the model. Blocking; returns the shrunk failing scenario in words.
pub fn check_inbox(harness: &dyn InboxHarness, config: Config) -> Result<(), String> {
    let rt = runtime()?;
    let mut runner = TestRunner::new(config);
    let result = runner.run(&inbox_scenario(), |scenario| {
        rt.block_on(async {
            let store = harness.fresh().await.map_err(|e| {
                TestCaseError::fail(format!("harness could not make an inbox: {e}"))
            })?;
            run_inbox_scenario(&*store, &scenario)
                .await
                .map_err(TestCaseError::fail)?;
            store
                .teardown()
                .await
                .map_err(|e| TestCaseError::fail(format!("harness teardown failed: {e}")))
        })
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, scenario)) => Err(format!(
            "{} broke the inbox property.\n{reason}\nshrunk scenario:\n{scenario:#?}",
            harness.name()
        )),
        Err(TestError::Abort(reason)) => Err(format!(
            "{}: inbox property aborted: {reason}",
            harness.name()
        )),
    }
}

/// Run `check` on a fresh inbox of `harness`, with a runtime of its own, tearing it down when
/// it passes.
fn run_check<F>(harness: &dyn InboxHarness, what: &str, check: F) -> Result<(), String>
where
    F: for<'a> FnOnce(&'a dyn InboxStore) -> futures::future::BoxFuture<'a, Result<(), String>>,
{
    runtime()?.block_on(async {
        let store = harness
            .fresh()
            .await
            .map_err(|e| format!("harness could not make an inbox: {e}"))?;
        check(&*store)
            .await
            .map_err(|r| format!("{} failed {what}: {r}", harness.name()))?;
        store
            .teardown()
            .await
            .map_err(|e| format!("harness teardown failed: {e}"))
    })
}

/// The batch form: an id given twice in one batch is new once, a batch mixing marked and new
/// ids tells each apart in order, a rolled-back batch leaves no mark, and consumers are kept
/// apart.
pub fn check_batch_receipts(harness: &dyn InboxHarness) -> Result<(), String> {
    run_check(harness, "the batch receipts check", |store| {
        Box::pin(async move {
            let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
            let [one, two, _] = CONSUMERS;
            let mut tx = store.begin().await.map_err(err("begin"))?;
            let got = tx.record(one, &[a, b, a]).await.map_err(err("record"))?;
            compare(
                "batch [a, b, a] on an empty inbox",
                &got,
                &[true, true, false],
            )?;
            tx.commit().await.map_err(err("commit"))?;

            let mut tx = store.begin().await.map_err(err("begin"))?;
            let got = tx.record(one, &[c, b, c, a]).await.map_err(err("record"))?;
            compare(
                "batch [c, b, c, a] after [a, b]",
                &got,
                &[true, false, false, false],
            )?;
            tx.rollback().await.map_err(err("rollback"))?;

            let mut tx = store.begin().await.map_err(err("begin"))?;
            let got = tx.record(one, &[c]).await.map_err(err("record"))?;
            compare("c after a rolled-back batch", &got, &[true])?;
            let got = tx.record(two, &[a, b]).await.map_err(err("record"))?;
            compare("another consumer's [a, b]", &got, &[true, true])?;
            let got = tx.record(two, &[]).await.map_err(err("record"))?;
            compare("an empty batch", &got, &[])?;
            tx.commit().await.map_err(err("commit"))?;

            let mut marks: Vec<Mark> = store.marks().await.map_err(err("reading the marks"))?;
            marks.sort();
            let mut expected: Vec<Mark> = [(one, a), (one, b), (one, c), (two, a), (two, b)]
                .into_iter()
                .map(|(n, id)| (n.to_owned(), id))
                .collect();
            expected.sort();
            if marks != expected {
                return Err(format!("marks {marks:?}, expected {expected:?}"));
            }
            Ok(())
        })
    })
}

/// Bad input is refused with [`Error::InvalidInput`] before anything is written: an empty
/// consumer name and one over 200 characters.
pub fn check_refusals(harness: &dyn InboxHarness) -> Result<(), String> {
    run_check(harness, "the refusals check", |store| {
        Box::pin(async move {
            let long = "c".repeat(201);
            for (what, consumer) in [
                ("an empty consumer name", ""),
                ("a 201-character consumer name", long.as_str()),
            ] {
                for ids in [vec![Uuid::new_v4()], vec![Uuid::new_v4(), Uuid::new_v4()]] {
                    let mut tx = store.begin().await.map_err(err("begin"))?;
                    match tx.record(consumer, &ids).await {
                        Err(Error::InvalidInput(_)) => {}
                        other => {
                            return Err(format!(
                                "recording {} id(s) for {what} gave {other:?}, expected \
                                 InvalidInput",
                                ids.len()
                            ))
                        }
                    }
                    tx.rollback().await.map_err(err("rollback"))?;
                }
            }
            let marks = store.marks().await.map_err(err("reading the marks"))?;
            if !marks.is_empty() {
                return Err(format!("refused records left marks: {marks:?}"));
            }
            Ok(())
        })
    })
}
