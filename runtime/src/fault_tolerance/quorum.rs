//! The quorum: which replica groups take a step together, decided once per round on the store so that every rank
//! reads the same answer (the first proposal written wins, `TcpStore::set_once`). The rule is torchft's
//! lighthouse's: take the groups that joined once every group still heartbeating has; after `quorum_timeout`, take
//! those that joined if they are at least `min_replicas` and more than half of the heartbeating ones (two halves of
//! a partitioned job never both go on); otherwise stop, naming the groups waited for.
use std::fmt;

/// The replica groups that take a round's step together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quorum {
    /// Changes exactly when the members do (their gloo group is made anew under it).
    pub id: u64,
    /// The groups taking part, ascending.
    pub members: Vec<usize>,
}

impl Quorum {
    /// The store's text for it: `<id>;<g>,<g>,..`.
    pub(crate) fn encode(&self) -> String {
        let members: Vec<String> = self.members.iter().map(usize::to_string).collect();
        format!("{};{}", self.id, members.join(","))
    }

    pub(crate) fn decode(text: &str) -> Option<Quorum> {
        let (id, members) = text.split_once(';')?;
        let members = members.split(',').filter(|m| !m.is_empty()).map(|m| m.parse().ok()).collect::<Option<_>>()?;
        Some(Quorum { id: id.parse().ok()?, members })
    }

    /// The quorum of `members` that follows this one: the same id if the members are the same.
    pub(crate) fn next(&self, members: Vec<usize>) -> Quorum {
        let id = if members == self.members { self.id } else { self.id + 1 };
        Quorum { id, members }
    }
}

impl fmt::Display for Quorum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let members: Vec<String> = self.members.iter().map(usize::to_string).collect();
        write!(f, "quorum {} of groups [{}]", self.id, members.join(", "))
    }
}

/// What a rank does next in a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Wait for more groups to join (or to be found lost).
    Wait,
    /// Propose these groups.
    Propose(Vec<usize>),
    /// No quorum can be had: why.
    Fail(String),
}

/// The decision from the groups that `joined` the round and those `healthy` (every rank heartbeating), both
/// ascending; `timed_out`: `quorum_timeout` has passed since this rank joined.
pub(crate) fn decide(joined: &[usize], healthy: &[usize], min_replicas: usize, timed_out: bool) -> Decision {
    let ready: Vec<usize> = joined.iter().copied().filter(|g| healthy.contains(g)).collect();
    let all_joined = healthy.iter().all(|g| joined.contains(g));
    let enough = ready.len() >= min_replicas && 2 * ready.len() > healthy.len();
    if enough && (all_joined || timed_out) {
        return Decision::Propose(ready);
    }
    if !timed_out {
        return Decision::Wait;
    }
    let (n, h) = (ready.len(), healthy.len());
    Decision::Fail(if n < min_replicas {
        format!(
            "{n} replica group(s) joined ({}) of the {h} still heartbeating ({}); `fault_tolerance.min_replicas` is {min_replicas}",
            list(&ready),
            list(healthy)
        )
    } else {
        format!(
            "{n} replica group(s) joined ({}), not more than half of the {h} still heartbeating ({}): a minority never goes on alone",
            list(&ready),
            list(healthy)
        )
    })
}

fn list(groups: &[usize]) -> String {
    let g: Vec<String> = groups.iter().map(usize::to_string).collect();
    if g.is_empty() {
        "none".into()
    } else {
        g.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_heartbeating_group_joined_is_a_quorum_at_once() {
        assert_eq!(decide(&[0, 1, 2], &[0, 1, 2], 1, false), Decision::Propose(vec![0, 1, 2]));
        // A group found lost is not waited for.
        assert_eq!(decide(&[0, 2], &[0, 2], 1, false), Decision::Propose(vec![0, 2]));
        // A group that joined and was then lost is left out.
        assert_eq!(decide(&[0, 1, 2], &[0, 2], 1, false), Decision::Propose(vec![0, 2]));
    }

    #[test]
    fn a_heartbeating_group_is_waited_for_until_the_timeout_then_a_majority_goes_on() {
        assert_eq!(decide(&[0, 2], &[0, 1, 2], 1, false), Decision::Wait);
        assert_eq!(decide(&[0, 2], &[0, 1, 2], 1, true), Decision::Propose(vec![0, 2]));
        // Half is not a majority: one of two heartbeating groups never goes on alone.
        assert!(matches!(decide(&[0], &[0, 1], 1, true), Decision::Fail(why) if why.contains("not more than half")));
    }

    #[test]
    fn fewer_than_min_replicas_waits_then_fails_naming_the_key() {
        assert_eq!(decide(&[0], &[0], 2, false), Decision::Wait);
        assert!(matches!(decide(&[0], &[0], 2, true), Decision::Fail(why) if why.contains("min_replicas` is 2")));
    }

    #[test]
    fn quorums_encode_and_keep_their_id_while_the_members_stay() {
        let q = Quorum { id: 3, members: vec![0, 2] };
        assert_eq!(Quorum::decode(&q.encode()), Some(q.clone()));
        assert_eq!(q.next(vec![0, 2]).id, 3);
        assert_eq!(q.next(vec![0]).id, 4);
    }
}
