//! Link views (Flint's per-link telemetry, docs/control-plane.md "Views"): what each target's
//! volumes move to and from each other target's pools, as its view agent measures it, kept as
//! soft state. Nothing is committed to the store: a view is a measurement its agent pushes
//! again at least every `VIEW_PUSH_INTERVAL_MS`, so a control plane that restarts (or a
//! standby that takes over) has every live link again within that interval, and a link whose
//! agent stopped pushing is marked stale, then forgotten.

use std::collections::BTreeMap;

use crate::limits::{LINKS_MAX, VIEW_STALE_MS};
use crate::model::{ApiError, ErrorCode, LinkView, ViewPush};

#[derive(Default)]
pub struct Links {
    map: BTreeMap<(String, String), LinkView>,
    version: u64,
}

impl Links {
    /// Takes a push of the link `from` -> `to`, both registered targets (`known`); its seq
    /// must be above the last one taken for that link.
    pub fn push(&mut self, from: &str, to: &str, push: &ViewPush, now_ms: u64, known: impl Fn(&str) -> bool) -> Result<LinkView, ApiError> {
        for t in [from, to] {
            if !known(t) {
                return Err(ApiError::new(ErrorCode::TargetNotFound, format!("no target {t}: register it first")));
            }
        }
        if from == to {
            return Err(ApiError::new(ErrorCode::InvalidArgument, format!("a link from {from} to itself")));
        }
        self.forget(now_ms);
        let key = (from.to_string(), to.to_string());
        match self.map.get(&key) {
            Some(old) if push.seq <= old.seq => {
                return Err(ApiError::new(
                    ErrorCode::StaleView,
                    format!("view seq {} of link {from} -> {to} is not above {}", push.seq, old.seq),
                ));
            }
            None if self.map.len() >= LINKS_MAX => {
                return Err(ApiError::new(ErrorCode::LimitExceeded, format!("{LINKS_MAX} links are viewed already")));
            }
            _ => {}
        }
        self.version += 1;
        let view = LinkView {
            from: key.0.clone(),
            to: key.1.clone(),
            seq: push.seq,
            version: self.version,
            received_ms: now_ms,
            figures: push.figures.clone(),
            stale: false,
        };
        self.map.insert(key, view.clone());
        Ok(view)
    }

    /// Every link's last view, stale when its agent has said nothing for VIEW_STALE_MS.
    pub fn views(&self, now_ms: u64) -> Vec<LinkView> {
        let age = |v: &LinkView| now_ms.saturating_sub(v.received_ms);
        // Those past forgetting are left out even when no push came to drop them.
        self.map.values().filter(|v| age(v) <= 2 * VIEW_STALE_MS).map(|v| LinkView { stale: age(v) > VIEW_STALE_MS, ..v.clone() }).collect()
    }

    /// Drops links silent for twice VIEW_STALE_MS: their targets stopped, or stopped using
    /// them (an agent pushes every link it has while it moves anything).
    fn forget(&mut self, now_ms: u64) {
        self.map.retain(|_, v| now_ms.saturating_sub(v.received_ms) <= 2 * VIEW_STALE_MS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;

    fn push(seq: u64, read_bps: f64) -> ViewPush {
        ViewPush { seq, figures: Figures { read_bps, ..Figures::default() } }
    }

    #[test]
    fn links_take_increasing_pushes_of_known_targets_and_go_stale() {
        let known = |t: &str| t == "a:1" || t == "b:1";
        let mut l = Links::default();
        let v = l.push("a:1", "b:1", &push(1, 5.0), 1000, known).unwrap();
        assert_eq!((v.version, v.seq, v.figures.read_bps), (1, 1, 5.0));
        assert_eq!(l.push("a:1", "b:1", &push(1, 6.0), 1001, known).unwrap_err().code, ErrorCode::StaleView);
        assert_eq!(l.push("a:1", "c:1", &push(1, 6.0), 1001, known).unwrap_err().code, ErrorCode::TargetNotFound);
        assert_eq!(l.push("c:1", "a:1", &push(1, 6.0), 1001, known).unwrap_err().code, ErrorCode::TargetNotFound);
        assert_eq!(l.push("a:1", "a:1", &push(1, 6.0), 1001, known).unwrap_err().code, ErrorCode::InvalidArgument);
        l.push("b:1", "a:1", &push(7, 1.0), 1002, known).unwrap();
        let v = l.push("a:1", "b:1", &push(2, 6.0), 1003, known).unwrap();
        assert_eq!((v.version, v.figures.read_bps), (3, 6.0));
        let views = l.views(1003);
        assert_eq!(
            views.iter().map(|v| (v.from.as_str(), v.to.as_str(), v.stale)).collect::<Vec<_>>(),
            [("a:1", "b:1", false), ("b:1", "a:1", false)]
        );
        // b's agent goes quiet: its link is stale, then forgotten at the next push.
        let later = 1003 + VIEW_STALE_MS + 1;
        l.push("a:1", "b:1", &push(3, 6.0), 1002 + VIEW_STALE_MS, known).unwrap();
        assert_eq!(l.views(later).iter().map(|v| v.stale).collect::<Vec<_>>(), [false, true]);
        assert_eq!(l.views(1003 + 2 * VIEW_STALE_MS).len(), 1, "the silent link is left out with no push to drop it");
        l.push("a:1", "b:1", &push(4, 6.0), 1003 + 2 * VIEW_STALE_MS, known).unwrap();
        assert_eq!(l.map.len(), 1, "and dropped at the next push");
    }

    #[test]
    fn links_are_bounded() {
        let mut l = Links::default();
        for i in 0..LINKS_MAX {
            l.push("a:1", &format!("t{i}:1"), &push(1, 0.0), 0, |_| true).unwrap();
        }
        assert_eq!(l.push("a:1", "x:1", &push(1, 0.0), 0, |_| true).unwrap_err().code, ErrorCode::LimitExceeded);
        // A known link still takes its pushes.
        l.push("a:1", "t0:1", &push(2, 0.0), 0, |_| true).unwrap();
    }
}
