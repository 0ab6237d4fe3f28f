//! One batch in flight: every partition key is a lane whose messages go out one at a time, each
//! sent when the one before it is acked; lanes of different keys run side by side.
//!
//! The batch's acks come back on one subscription (a fresh inbox per batch, each message's reply
//! subject naming its index), read by the same task that sends. The JetStream context's own
//! publish would add, per message, an ack permit, a one-shot channel, a request-table entry, two
//! timers and a boxed future; here a message costs its publish command and an entry in a queue
//! of deadlines, and the batch shares one timer.

use std::collections::VecDeque;
use std::pin::pin;

use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::response::Response;
use async_nats::jetstream::ErrorCode;
use async_nats::{PublishErrorKind, StatusCode};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use outbox_traits::{KeyGate, Message, PublishOutcome};
use outbox_url::redact_url;
use tokio::time::Instant;

use crate::publisher::{headers_for, NatsPublisher};
use crate::subject;

/// Where one message of the batch stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Not sent (yet).
    Waiting,
    /// Sent; its ack is awaited until its deadline.
    Sent,
    /// Answered "duplicate"; the stored message is being read back (FM-C4).
    Verifying,
    /// Has its outcome.
    Done,
}

/// What an answer on the ack inbox means for its message.
enum Answer {
    Outcome(PublishOutcome),
    /// A "duplicate" ack, to verify against the stream before it counts.
    Duplicate(PublishAck),
}

/// Why a send left nothing to wait for.
struct NotSent {
    outcome: PublishOutcome,
    /// The client's command queue did not take the publish in time: the connection is stuck.
    broken: bool,
}

pub(crate) struct Flight<'a> {
    publisher: &'a NatsPublisher,
    batch: &'a [Message],
    /// Message indexes of each lane, in publish order.
    lanes: Vec<Vec<usize>>,
    /// Per lane: how many of its messages were sent (or given an outcome without a send).
    cursor: Vec<usize>,
    lane_of: Vec<usize>,
    stage: Vec<Stage>,
    outcomes: Vec<PublishOutcome>,
    /// Closes a key at its first message that is not acked: the rest of its lane is not sent.
    gate: KeyGate<'a>,
    /// Sent messages with their ack deadlines, in send order (so deadlines ascend). Entries whose
    /// message has left `Sent` are skipped when they reach the front.
    deadlines: VecDeque<(Instant, usize)>,
    /// Lanes started and not finished.
    active: usize,
    next_lane: usize,
    /// Messages sent whose outcome is not known yet (awaiting an ack or being verified).
    open: usize,
    /// The server stopped answering: nothing more is sent in this batch.
    broken: bool,
    inbox: String,
}

impl<'a> Flight<'a> {
    pub(crate) fn new(publisher: &'a NatsPublisher, batch: &'a [Message]) -> Self {
        let mut lanes: Vec<Vec<usize>> = Vec::new();
        let mut lane_of = Vec::with_capacity(batch.len());
        let mut lane_of_key: std::collections::HashMap<&str, usize> =
            std::collections::HashMap::with_capacity(batch.len());
        for (index, msg) in batch.iter().enumerate() {
            let lane = match msg.partition_key.as_deref() {
                Some(key) => *lane_of_key.entry(key).or_insert_with(|| {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                }),
                None => {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                }
            };
            lanes[lane].push(index);
            lane_of.push(lane);
        }
        Self {
            publisher,
            batch,
            cursor: vec![0; lanes.len()],
            lanes,
            lane_of,
            stage: vec![Stage::Waiting; batch.len()],
            outcomes: vec![PublishOutcome::NotAttempted; batch.len()],
            gate: KeyGate::new(),
            deadlines: VecDeque::with_capacity(batch.len()),
            active: 0,
            next_lane: 0,
            open: 0,
            broken: false,
            inbox: publisher.client().new_inbox(),
        }
    }

    /// Publish the batch and give each message its outcome.
    pub(crate) async fn run(mut self) -> Vec<PublishOutcome> {
        let client = self.publisher.client();
        let timeout = self.publisher.config().timeout;
        let subscribed =
            tokio::time::timeout(timeout, client.subscribe(format!("{}.*", self.inbox))).await;
        let mut answers = match subscribed {
            Ok(Ok(sub)) => sub,
            Ok(Err(e)) => return self.none_sent(&format!("cannot subscribe for its acks: {e}")),
            Err(_) => {
                return self.none_sent(&format!(
                    "the NATS client did not take its ack subscription within {timeout:?}"
                ))
            }
        };
        let (publisher, batch) = (self.publisher, self.batch);
        let mut verifying = FuturesUnordered::new();
        let mut timer = pin!(tokio::time::sleep_until(Instant::now() + timeout));
        let mut armed: Option<Instant> = None;
        let mut answers_closed = false;
        self.fill(None).await;
        while self.open > 0 {
            while let Some(&(_, index)) = self.deadlines.front() {
                if self.stage[index] == Stage::Sent {
                    break;
                }
                self.deadlines.pop_front();
            }
            let front = self.deadlines.front().map(|&(at, _)| at);
            if front.is_some() && front != armed {
                if let Some(at) = front {
                    timer.as_mut().reset(at);
                }
                armed = front;
            }
            tokio::select! {
                biased;
                answer = answers.next(), if !answers_closed => match answer {
                    Some(answer) => match self.read_answer(&answer) {
                        Some((index, Answer::Outcome(outcome))) => {
                            self.open -= 1;
                            self.finish(index, outcome).await;
                        }
                        Some((index, Answer::Duplicate(ack))) => {
                            self.stage[index] = Stage::Verifying;
                            verifying.push(async move {
                                (index, publisher.verify_duplicate(&batch[index], &ack).await)
                            });
                        }
                        None => {}
                    },
                    // The client is gone: no ack can come any more.
                    None => {
                        answers_closed = true;
                        self.broken = true;
                        self.give_up_on_sent("the NATS connection closed before its ack came");
                    }
                },
                Some((index, outcome)) = verifying.next(), if !verifying.is_empty() => {
                    self.open -= 1;
                    self.finish(index, outcome).await;
                }
                () = &mut timer, if armed.is_some() => {
                    armed = None;
                    if let Some((_, index)) = self.deadlines.pop_front() {
                        if self.stage[index] == Stage::Sent {
                            self.open -= 1;
                            self.broken = true;
                            let subject = self.subject_of(index);
                            self.settle(index, PublishOutcome::Ambiguous {
                                reason: format!(
                                    "no JetStream ack for {subject} within {timeout:?}"
                                ),
                            });
                        }
                    }
                }
            }
        }
        self.close()
    }

    /// Send the next message of `lane` (a lane whose last message just got its outcome), then
    /// start new lanes while fewer than `max_in_flight` are running. A lane whose send ends
    /// without an ack to wait for moves on at once.
    async fn fill(&mut self, mut lane: Option<usize>) {
        let max = self.publisher.config().max_in_flight.max(1);
        loop {
            if self.broken {
                return;
            }
            let current = match lane.take() {
                Some(current) => current,
                None => {
                    if self.active >= max || self.next_lane >= self.lanes.len() {
                        return;
                    }
                    self.active += 1;
                    self.next_lane += 1;
                    self.next_lane - 1
                }
            };
            let Some(index) = self.next_of(current) else {
                self.active -= 1;
                continue;
            };
            self.cursor[current] += 1;
            match self.send(index).await {
                Ok(()) => {}
                Err(NotSent { outcome, broken }) => {
                    self.settle(index, outcome);
                    self.broken |= broken;
                    lane = Some(current);
                }
            }
        }
    }

    /// The lane's next message to send, unless the lane is finished or its key was closed by a
    /// message that was not acked.
    fn next_of(&self, lane: usize) -> Option<usize> {
        let next = *self.lanes[lane].get(self.cursor[lane])?;
        self.gate.admits(&self.batch[next]).then_some(next)
    }

    /// Give message `index` its final outcome; one that is not acked closes its key.
    fn settle(&mut self, index: usize, outcome: PublishOutcome) {
        let batch = self.batch;
        self.gate.record(&batch[index], &outcome);
        self.stage[index] = Stage::Done;
        self.outcomes[index] = outcome;
    }

    async fn send(&mut self, index: usize) -> Result<(), NotSent> {
        let msg = &self.batch[index];
        let config = self.publisher.config();
        let subject = config.subject.render_with(msg, subject::sanitize_value);
        let headers = headers_for(msg, &config.envelope).map_err(|reason| NotSent {
            outcome: PublishOutcome::permanent(reason),
            broken: false,
        })?;
        let reply = format!("{}.{index}", self.inbox);
        let sent = tokio::time::timeout(
            config.timeout,
            self.publisher.client().publish_with_reply_and_headers(
                subject,
                reply,
                headers,
                config.envelope.body(msg).into_owned().into(),
            ),
        )
        .await;
        match sent {
            Ok(Ok(())) => {
                self.stage[index] = Stage::Sent;
                self.open += 1;
                self.deadlines
                    .push_back((Instant::now() + config.timeout, index));
                Ok(())
            }
            Ok(Err(e)) => {
                let subject = self.subject_of(index);
                let detail = redact_url(&e.to_string());
                let outcome = if e.kind() == PublishErrorKind::MaxPayloadExceeded {
                    PublishOutcome::permanent(format!(
                        "message for {subject} is larger than the NATS server's max_payload: \
                         {detail}; store large bodies elsewhere and publish a reference"
                    ))
                } else {
                    PublishOutcome::transient(format!(
                        "NATS publish to {subject} not sent: {detail}"
                    ))
                };
                Err(NotSent {
                    outcome,
                    broken: false,
                })
            }
            // Nothing left the client: its command queue did not take the publish in time.
            Err(_) => Err(NotSent {
                outcome: PublishOutcome::transient(format!(
                    "NATS publish to {} not sent: the client's queue did not take it within {:?}",
                    self.subject_of(index),
                    config.timeout
                )),
                broken: true,
            }),
        }
    }

    /// Which message an answer on the inbox is for, and what it says; `None` for an answer that
    /// is for no message still waiting (a late ack after its deadline, or a stray).
    fn read_answer(&mut self, answer: &async_nats::Message) -> Option<(usize, Answer)> {
        let index: usize = answer
            .subject
            .strip_prefix(self.inbox.as_str())?
            .strip_prefix('.')?
            .parse()
            .ok()?;
        if self.stage.get(index) != Some(&Stage::Sent) {
            return None;
        }
        if answer.status == Some(StatusCode::NO_RESPONDERS) {
            // No stream captures the subject, so nothing was stored. Transient because creating
            // the stream fixes it without touching the message; the relay's max_attempts still
            // dead-letters it if nobody does.
            return Some((
                index,
                Answer::Outcome(PublishOutcome::transient(format!(
                    "no JetStream stream captures subject {} (no responders); create a stream \
                     for it or set create_stream=true",
                    self.subject_of(index)
                ))),
            ));
        }
        let outcome = match serde_json::from_slice::<Response<PublishAck>>(&answer.payload) {
            Ok(Response::Ok(ack)) if !ack.duplicate => PublishOutcome::Acked,
            Ok(Response::Ok(ack)) => return Some((index, Answer::Duplicate(ack))),
            Ok(Response::Err { error })
                if error.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM =>
            {
                PublishOutcome::permanent(format!(
                    "message for {} is larger than the stream's max_msg_size: {error}; store \
                     large bodies elsewhere and publish a reference",
                    self.subject_of(index)
                ))
            }
            Ok(Response::Err { error }) => PublishOutcome::transient(format!(
                "JetStream refused {}: {error}",
                self.subject_of(index)
            )),
            // An answer we cannot read: it may have been stored.
            Err(e) => PublishOutcome::Ambiguous {
                reason: format!(
                    "unreadable JetStream answer for {} (status {:?}): {e}",
                    self.subject_of(index),
                    answer.status
                ),
            },
        };
        Some((index, Answer::Outcome(outcome)))
    }

    /// Record a sent message's outcome and move its lane on.
    async fn finish(&mut self, index: usize, outcome: PublishOutcome) {
        self.settle(index, outcome);
        let lane = self.lane_of[index];
        if self.broken {
            return;
        }
        self.fill(Some(lane)).await;
    }

    /// Every message still awaiting its ack becomes ambiguous: it may have been stored.
    fn give_up_on_sent(&mut self, why: &str) {
        for index in 0..self.batch.len() {
            if self.stage[index] == Stage::Sent {
                self.open -= 1;
                let reason = format!("{}: {why}", self.subject_of(index));
                self.settle(index, PublishOutcome::Ambiguous { reason });
            }
        }
    }

    /// The outcomes, with the messages never sent filled in: after the server stopped answering,
    /// the next message of each unfinished lane fails as transient and the rest of the lane is
    /// not attempted (a lane that stopped at a failed message leaves the rest not attempted).
    fn close(mut self) -> Vec<PublishOutcome> {
        if self.broken {
            for lane in 0..self.lanes.len() {
                if let Some(index) = self.next_of(lane) {
                    self.outcomes[index] = PublishOutcome::transient(
                        "not sent: NATS stopped answering earlier in this batch",
                    );
                }
            }
        }
        self.outcomes
    }

    /// Every message fails as transient: nothing was sent.
    fn none_sent(self, why: &str) -> Vec<PublishOutcome> {
        let reason = format!("not sent: {}", redact_url(why));
        self.batch
            .iter()
            .map(|_| PublishOutcome::transient(reason.clone()))
            .collect()
    }

    fn subject_of(&self, index: usize) -> String {
        self.publisher
            .config()
            .subject
            .render_with(&self.batch[index], subject::sanitize_value)
    }
}
