//! The PIFO's ordering alone: who leaves next, shares by weight and cost, no starvation.

use super::*;

const KIB: f64 = 1.0;

/// Bytes (in cost units) each stream got in the first `n` requests to leave.
fn drain(o: &mut Order<(usize, f64)>, n: usize) -> Vec<f64> {
    let mut got = vec![0.0; 8];
    for _ in 0..n {
        let (s, _, (_, units)) = o.pop(|_| true).expect("waiting");
        got[s] += units;
    }
    got
}

#[test]
fn a_small_request_leaves_before_another_streams_backlog() {
    for (policy, place) in [(Policy::Pifo, 0), (Policy::Fifo, 31)] {
        let mut o = Order::new(policy);
        let (bg, victim) = (o.open(100).unwrap(), o.open(100).unwrap());
        for i in 0..32 {
            o.push(bg, 0, 128.0 * KIB, i);
        }
        // The first large one is on the wire already.
        assert_eq!(o.pop(|_| true).map(|(s, _, i)| (s, i)), Some((bg, 0)));
        o.push(victim, 0, 4.0 * KIB, 99);
        let order: Vec<usize> = std::iter::from_fn(|| o.pop(|_| true).map(|(_, _, i)| i)).collect();
        assert_eq!(order.iter().position(|&i| i == 99), Some(place), "{policy:?}: {order:?}");
        assert_eq!(order.len(), 32);
    }
}

#[test]
fn backlogged_streams_share_cost_units_by_weight_whatever_their_sizes() {
    // (weights, sizes in units): a 64-unit stream against a 4-unit one, 1:1 and 2:1.
    for (wa, wb, want) in [(100, 100, 0.5), (200, 100, 2.0 / 3.0), (100, 300, 0.25)] {
        let mut o = Order::new(Policy::Pifo);
        let (a, b) = (o.open(wa).unwrap(), o.open(wb).unwrap());
        for _ in 0..200 {
            o.push(a, 0, 64.0, (a, 64.0));
        }
        for _ in 0..3200 {
            o.push(b, 0, 4.0, (b, 4.0));
        }
        let got = drain(&mut o, 1000);
        let share = got[a] / (got[a] + got[b]);
        assert!((share - want).abs() < 0.02, "weights {wa}:{wb}: share {share:.3}, want {want:.3} ({got:?})");
    }
}

#[test]
fn writes_pay_the_lanes_write_cost_and_a_loaded_lane_weighs_more() {
    let view = LaneView { write_cost: 3.0, queue_depth: 0.0 };
    assert_eq!(view.factor(false), 1.0);
    assert_eq!(view.factor(true), 3.0);
    let loaded = LaneView { write_cost: 1.0, queue_depth: PIFO_LOAD_DEPTH };
    assert_eq!(loaded.factor(false), 2.0);
    // Nonsense from a view is clamped, never trusted.
    assert_eq!(LaneView { write_cost: f64::NAN, queue_depth: -5.0 }.factor(true), 1.0);
    assert_eq!(LaneView { write_cost: 0.1, queue_depth: f64::NAN }.factor(true), 1.0);
    let huge = LaneView { write_cost: 1e300, queue_depth: 1e300 }.factor(true);
    assert_eq!(huge, PIFO_WRITE_COST_MAX * (1.0 + PIFO_QUEUE_DEPTH_MAX / PIFO_LOAD_DEPTH));

    // A writer at cost 3 beside a reader of the same sizes: the reader moves 3x the bytes.
    let mut o = Order::new(Policy::Pifo);
    let (w, r) = (o.open(100).unwrap(), o.open(100).unwrap());
    for _ in 0..500 {
        o.push(w, 0, 16.0 * view.factor(true), (w, 16.0));
        o.push(r, 0, 16.0 * view.factor(false), (r, 16.0));
    }
    let got = drain(&mut o, 400);
    let ratio = got[r] / got[w];
    assert!((ratio - 3.0).abs() < 0.1, "reader/writer bytes {ratio:.2} ({got:?})");
}

#[test]
fn a_large_request_is_not_starved_by_a_stream_of_small_ones() {
    let mut o = Order::new(Policy::Pifo);
    let (big, small) = (o.open(100).unwrap(), o.open(100).unwrap());
    o.push(big, 0, 1024.0, (big, 1024.0));
    // Small requests keep arriving, one for each that leaves (a QD 1 stream would be worse
    // for the big one only if ranks did not age).
    let mut left = 0;
    for _ in 0..10_000 {
        o.push(small, 0, 4.0, (small, 4.0));
        let (s, _, _) = o.pop(|_| true).unwrap();
        left += 1;
        if s == big {
            break;
        }
    }
    // The big one's rank is 1024 units after V; 4-unit requests reach it after 256 of them.
    assert!(left <= 257, "the large request left after {left}");
    assert!(o.streams[big].as_ref().unwrap().queue.is_empty(), "never left");
}

#[test]
fn an_idle_stream_saves_up_no_credit() {
    let mut o = Order::new(Policy::Pifo);
    let (a, b) = (o.open(100).unwrap(), o.open(100).unwrap());
    // a runs alone for a long while.
    for _ in 0..1000 {
        o.push(a, 0, 4.0, (a, 4.0));
        o.pop(|_| true);
    }
    // b arrives with a backlog, a keeps its own: from here they share equally; b does not
    // get the 4000 units a moved as a burst of its own.
    for _ in 0..100 {
        o.push(a, 0, 4.0, (a, 4.0));
        o.push(b, 0, 4.0, (b, 4.0));
    }
    let got = drain(&mut o, 100);
    assert!((got[a] - got[b]).abs() <= 8.0, "{got:?}");
}

#[test]
fn a_full_lane_holds_only_the_streams_whose_head_goes_there() {
    let mut o = Order::new(Policy::Pifo);
    let (a, b) = (o.open(100).unwrap(), o.open(100).unwrap());
    o.push(a, 1, 1.0, (a, 1.0)); // lane 1 is full
    o.push(a, 0, 1.0, (a, 1.0)); // behind it in a's FIFO
    o.push(b, 0, 8.0, (b, 8.0));
    let (s, lane, _) = o.pop(|l| l == 0).unwrap();
    assert_eq!((s, lane), (b, 0), "b's head goes to a lane with room; a waits in its own order");
    assert!(o.pop(|l| l == 0).is_none(), "a's second request may not pass its first");
    assert_eq!(o.pop(|_| true).map(|(s, l, _)| (s, l)), Some((a, 1)));
    assert_eq!(o.pop(|_| true).map(|(s, l, _)| (s, l)), Some((a, 0)));
    assert_eq!(o.waiting(), 0);
}

#[test]
fn streams_are_bounded_and_closing_gives_back_their_waiting_requests() {
    let mut o: Order<u32> = Order::new(Policy::Pifo);
    let ids: Vec<usize> = (0..PIFO_STREAMS_MAX).map(|_| o.open(100).unwrap()).collect();
    assert_eq!(o.open(100), None, "more than PIFO_STREAMS_MAX streams");
    o.push(ids[7], 0, 1.0, 1);
    o.push(ids[7], 0, 1.0, 2);
    assert_eq!(o.waiting(), 2);
    assert_eq!(o.close(ids[7]), vec![1, 2]);
    assert_eq!(o.waiting(), 0);
    assert!(!o.is_open(ids[7]));
    assert_eq!(o.open(0), Some(ids[7]), "the slot is reused; weight 0 is taken as 1");
    assert!(o.pop(|_| true).is_none());
    // Requests whose callers gave up leave from the middle of a stream, the order kept.
    for i in 0..5 {
        o.push(ids[3], 0, 1.0, i);
    }
    assert_eq!(o.retain(ids[3], |&i| i % 2 == 0), 2);
    assert_eq!(o.waiting(), 3);
    assert_eq!(std::iter::from_fn(|| o.pop(|_| true).map(|(_, _, i)| i)).collect::<Vec<_>>(), [0, 2, 4]);
    assert_eq!(o.retain(99_999, |_| false), 0, "no such stream");
}
