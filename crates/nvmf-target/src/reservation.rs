//! The reservation state of one namespace and its rules (NVMe Base 2.0, "Reservations"):
//! registrants keyed by Host Identifier, the reservation and its holder, and what Register,
//! Acquire and Release do to them. Pure: no I/O, no locks; the caller delivers the notices
//! and persists the state (docs/protocol.md, "Reservations").

use nearstore_wire::resv::{
    cptpl, notice, racqa, rrega, rrela, Cdw10, Keys, Registrant as Reported, ReservationStatus, Rtype, CNTLID_DYNAMIC,
};
use nearstore_wire::Status;

pub type HostId = [u8; 16];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Registrant {
    pub host: HostId,
    pub key: u64,
}

/// What a command may do to the namespace's data.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Access {
    /// The read command group (Read; a compute command without outputs).
    Read,
    /// The write command group (Write, Write Zeroes, Dataset Management, Flush; a compute
    /// command with outputs).
    Write,
}

/// A notice for every controller of `host` (Reservation Notification log page type).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Notice {
    pub host: HostId,
    pub kind: u8,
}

#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Reservations {
    /// Incremented by every successful Register, Preempt and Clear.
    pub generation: u32,
    /// In registration order.
    pub registrants: Vec<Registrant>,
    pub rtype: Option<Rtype>,
    /// The holder of a reservation of a type other than All Registrants (every registrant
    /// holds one of those).
    pub holder: Option<HostId>,
    /// Persist Through Power Loss.
    pub ptpl: bool,
}

/// What a command changed: notices to deliver, the hosts a preempt unregistered, and
/// whether the state is new (to persist).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Effects {
    pub notices: Vec<Notice>,
    /// Hosts other than the issuer whose registration a Preempt (or Preempt and Abort)
    /// removed: with Preempt and Abort, their commands on the namespace are aborted.
    pub preempted: Vec<HostId>,
    pub changed: bool,
}

fn conflict() -> Status {
    Status::RESERVATION_CONFLICT.dnr()
}

fn invalid() -> Status {
    Status::INVALID_FIELD.dnr()
}

impl Reservations {
    pub fn key_of(&self, host: &HostId) -> Option<u64> {
        self.registrants.iter().find(|r| r.host == *host).map(|r| r.key)
    }

    pub fn is_holder(&self, host: &HostId) -> bool {
        match self.rtype {
            None => false,
            Some(t) if t.all_registrants() => self.key_of(host).is_some(),
            Some(_) => self.holder == Some(*host),
        }
    }

    /// Whether `host` may run a command of this group (NVMe Base, "Command Behavior in the
    /// Presence of a Reservation").
    pub fn allows(&self, host: &HostId, access: Access) -> bool {
        let Some(t) = self.rtype else { return true };
        if self.is_holder(host) {
            return true;
        }
        match access {
            Access::Read if !t.exclusive_access() => true,
            _ => t.registrants_have_access() && self.key_of(host).is_some(),
        }
    }

    /// The host's registration with `key` checked (or not, with IEKEY where allowed).
    fn check_key(&self, host: &HostId, key: u64, ignore: bool) -> Result<(), Status> {
        match self.key_of(host) {
            Some(k) if ignore || k == key => Ok(()),
            _ => Err(conflict()),
        }
    }

    fn others(&self, host: &HostId, kind: u8) -> Vec<Notice> {
        self.registrants.iter().filter(|r| r.host != *host).map(|r| Notice { host: r.host, kind }).collect()
    }

    /// Removes the registrants whose key is `key` (the issuer too), with Registration
    /// Preempted for each but the issuer; the reservation goes if its holder went. None if
    /// no registrant had that key.
    fn remove_by_key(&mut self, issuer: &HostId, key: u64, skip_issuer: bool, fx: &mut Effects) -> Option<()> {
        let before = self.registrants.len();
        let mut removed = Vec::new();
        self.registrants.retain(|r| {
            let gone = r.key == key && !(skip_issuer && r.host == *issuer);
            if gone {
                removed.push(r.host);
            }
            !gone
        });
        if self.registrants.len() == before {
            return None;
        }
        for h in removed {
            if h != *issuer {
                fx.notices.push(Notice { host: h, kind: notice::REGISTRATION_PREEMPTED });
                fx.preempted.push(h);
            }
            if self.holder == Some(h) {
                self.rtype = None;
                self.holder = None;
            }
        }
        if self.registrants.is_empty() {
            self.rtype = None;
            self.holder = None;
        }
        Some(())
    }

    fn set_reservation(&mut self, host: &HostId, t: Rtype) {
        self.rtype = Some(t);
        self.holder = (!t.all_registrants()).then_some(*host);
    }

    /// Reservation Register (action, IEKEY, CPTPL; CRKEY, NRKEY). `ptpl_capable`: the
    /// namespace has somewhere to persist to.
    pub fn register(
        &mut self,
        host: &HostId,
        cmd: Cdw10,
        keys: Keys,
        ptpl_capable: bool,
        registrants_max: usize,
    ) -> Result<Effects, Status> {
        let (action, iekey, crkey, nrkey) = (cmd.action, cmd.iekey, keys.current, keys.other);
        let ptpl = match cmd.cptpl {
            cptpl::NO_CHANGE => self.ptpl,
            cptpl::CLEAR => false,
            cptpl::SET if ptpl_capable => true,
            _ => return Err(invalid()),
        };
        let mut fx = Effects::default();
        match action {
            rrega::REGISTER => match self.key_of(host) {
                Some(k) if k == nrkey => {}
                Some(_) => return Err(conflict()),
                None if self.registrants.len() >= registrants_max => return Err(Status::INTERNAL_ERROR.dnr()),
                None => self.registrants.push(Registrant { host: *host, key: nrkey }),
            },
            rrega::UNREGISTER => {
                self.check_key(host, crkey, iekey)?;
                self.registrants.retain(|r| r.host != *host);
                match self.rtype {
                    Some(_) if self.registrants.is_empty() => {
                        self.rtype = None;
                        self.holder = None;
                    }
                    Some(t) if !t.all_registrants() && self.holder == Some(*host) => {
                        self.rtype = None;
                        self.holder = None;
                        if t.registrants_have_access() {
                            fx.notices = self.others(host, notice::RESERVATION_RELEASED);
                        }
                    }
                    _ => {}
                }
            }
            rrega::REPLACE => match self.registrants.iter().position(|r| r.host == *host) {
                Some(i) if iekey || self.registrants[i].key == crkey => self.registrants[i].key = nrkey,
                Some(_) => return Err(conflict()),
                None if !iekey => return Err(conflict()),
                None if self.registrants.len() >= registrants_max => return Err(Status::INTERNAL_ERROR.dnr()),
                None => self.registrants.push(Registrant { host: *host, key: nrkey }),
            },
            _ => return Err(invalid()),
        }
        self.ptpl = ptpl;
        self.generation = self.generation.wrapping_add(1);
        fx.changed = true;
        Ok(fx)
    }

    /// Reservation Acquire: acquire, preempt, preempt and abort. The state changes the same
    /// for both preempts; aborting the preempted hosts' commands (`Effects::preempted`) is
    /// the caller's.
    pub fn acquire(&mut self, host: &HostId, cmd: Cdw10, keys: Keys) -> Result<Effects, Status> {
        let (action, crkey, prkey) = (cmd.action, keys.current, keys.other);
        let Some(new) = Rtype::from_u8(cmd.rtype).filter(|_| !cmd.iekey && action <= racqa::PREEMPT_AND_ABORT) else {
            return Err(invalid());
        };
        self.check_key(host, crkey, false)?;
        let mut fx = Effects::default();
        if action == racqa::ACQUIRE {
            return match self.rtype {
                None => {
                    self.set_reservation(host, new);
                    fx.changed = true;
                    Ok(fx)
                }
                Some(t) if t == new && self.is_holder(host) => Ok(fx),
                Some(_) => Err(conflict()),
            };
        }
        match (self.rtype, self.holder) {
            (None, _) => self.remove_by_key(host, prkey, false, &mut fx).ok_or_else(conflict)?,
            (Some(t), _) if t.all_registrants() => {
                if prkey == 0 {
                    let others = self.others(host, notice::REGISTRATION_PREEMPTED);
                    self.registrants.retain(|r| r.host == *host);
                    fx.preempted = others.iter().map(|n| n.host).collect();
                    fx.notices = others;
                    self.set_reservation(host, new);
                } else {
                    self.remove_by_key(host, prkey, false, &mut fx).ok_or_else(conflict)?;
                }
            }
            (Some(t), Some(h)) if self.key_of(&h) == Some(prkey) => {
                // The holder is preempted (or the holder changes its own type): the
                // registrants with its key go, the issuer holds the new reservation.
                self.remove_by_key(host, prkey, true, &mut fx);
                self.set_reservation(host, new);
                if t != new {
                    fx.notices.extend(self.others(host, notice::RESERVATION_RELEASED));
                }
            }
            _ if prkey == 0 => return Err(invalid()),
            _ => self.remove_by_key(host, prkey, false, &mut fx).ok_or_else(conflict)?,
        }
        self.generation = self.generation.wrapping_add(1);
        fx.changed = true;
        Ok(fx)
    }

    /// Reservation Release: release or clear.
    pub fn release(&mut self, host: &HostId, cmd: Cdw10, crkey: u64) -> Result<Effects, Status> {
        let action = cmd.action;
        if cmd.iekey || action > rrela::CLEAR {
            return Err(invalid());
        }
        self.check_key(host, crkey, false)?;
        let mut fx = Effects::default();
        if action == rrela::CLEAR {
            fx.notices = self.others(host, notice::RESERVATION_PREEMPTED);
            self.registrants.clear();
            self.rtype = None;
            self.holder = None;
            self.generation = self.generation.wrapping_add(1);
            fx.changed = true;
            return Ok(fx);
        }
        let Some(t) = self.rtype.filter(|_| self.is_holder(host)) else {
            // Releasing a reservation one does not hold does nothing.
            return Ok(fx);
        };
        if t as u8 != cmd.rtype {
            return Err(invalid());
        }
        self.rtype = None;
        self.holder = None;
        if t.registrants_have_access() {
            fx.notices = self.others(host, notice::RESERVATION_RELEASED);
        }
        fx.changed = true;
        Ok(fx)
    }

    /// The Reservation Status extended data structure.
    pub fn report(&self) -> ReservationStatus {
        ReservationStatus {
            generation: self.generation,
            rtype: self.rtype.map_or(0, |t| t as u8),
            regctl: self.registrants.len() as u16,
            ptpls: self.ptpl,
            registrants: self
                .registrants
                .iter()
                .map(|r| Reported { cntlid: CNTLID_DYNAMIC, holder: self.is_holder(&r.host), hostid: r.host, rkey: r.key })
                .collect(),
        }
    }
}

/// The state file (docs/protocol.md, "Reservation state file"): little-endian.
const FILE_MAGIC: &[u8; 8] = b"NSRESV\0\x01";
const FILE_HEADER_LEN: usize = 24;
const FILE_ENTRY_LEN: usize = 32;

impl Reservations {
    pub fn encode_file(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(FILE_HEADER_LEN + self.registrants.len() * FILE_ENTRY_LEN + 4);
        b.extend_from_slice(FILE_MAGIC);
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.push(self.rtype.map_or(0, |t| t as u8));
        b.push(self.ptpl as u8);
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&(self.registrants.len() as u32).to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        for r in &self.registrants {
            b.extend_from_slice(&r.host);
            b.extend_from_slice(&r.key.to_le_bytes());
            b.push((self.holder == Some(r.host)) as u8);
            b.extend_from_slice(&[0; 7]);
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a state file; the error names what is wrong with it.
    pub fn decode_file(b: &[u8], registrants_max: usize) -> Result<Reservations, String> {
        if b.len() < FILE_HEADER_LEN + 4 || &b[..8] != FILE_MAGIC {
            return Err("not a nearstore reservation state file (magic)".into());
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32c::crc32c(body).to_le_bytes() != crc {
            return Err("checksum mismatch".into());
        }
        let le32 = |o: usize| u32::from_le_bytes([body[o], body[o + 1], body[o + 2], body[o + 3]]);
        let count = le32(16) as usize;
        if count > registrants_max || body.len() != FILE_HEADER_LEN + count * FILE_ENTRY_LEN {
            return Err(format!("{count} registrants do not match the file's length"));
        }
        let rtype = match body[12] {
            0 => None,
            t => Some(Rtype::from_u8(t).ok_or_else(|| format!("reservation type {t}"))?),
        };
        let mut s = Reservations { generation: le32(8), rtype, ptpl: body[13] != 0, ..Default::default() };
        for e in body[FILE_HEADER_LEN..].chunks_exact(FILE_ENTRY_LEN) {
            let mut host = [0u8; 16];
            host.copy_from_slice(&e[..16]);
            let mut key = [0u8; 8];
            key.copy_from_slice(&e[16..24]);
            s.registrants.push(Registrant { host, key: u64::from_le_bytes(key) });
            if e[24] & 1 != 0 {
                s.holder = Some(host);
            }
        }
        let holder_ok = match rtype {
            None => s.holder.is_none(),
            Some(t) if t.all_registrants() => s.holder.is_none() && !s.registrants.is_empty(),
            Some(_) => s.holder.is_some(),
        };
        if !holder_ok {
            return Err("the reservation's holder does not match its type".into());
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nearstore_wire::resv::Rtype::*;

    const A: HostId = [0xa; 16];
    const B: HostId = [0xb; 16];
    const C: HostId = [0xc; 16];
    const KA: u64 = 0xaaaa;
    const KB: u64 = 0xbbbb;
    const KC: u64 = 0xcccc;
    const MAX: usize = 8;

    type RegisterCase = (Option<u64>, u8, bool, u8, u64, u64, Status, Option<u64>);
    type AcquireCase = (HostId, u64, u8, Rtype, u64, Status, Option<Rtype>, Option<HostId>);
    type ReleaseCase = (Rtype, HostId, u64, u8, u8, Status, Option<Rtype>, &'static [(HostId, u8)]);

    fn reg(
        s: &mut Reservations,
        host: &HostId,
        action: u8,
        iekey: bool,
        cptpl: u8,
        keys: (u64, u64),
        capable: bool,
    ) -> Result<Effects, Status> {
        let cmd = Cdw10 { action, iekey, cptpl, rtype: 0 };
        s.register(host, cmd, Keys { current: keys.0, other: keys.1 }, capable, MAX)
    }

    fn acq(s: &mut Reservations, host: &HostId, action: u8, rtype: u8, iekey: bool, keys: (u64, u64)) -> Result<Effects, Status> {
        s.acquire(host, Cdw10 { action, iekey, rtype, cptpl: 0 }, Keys { current: keys.0, other: keys.1 })
    }

    fn rel(s: &mut Reservations, host: &HostId, action: u8, rtype: u8, iekey: bool, crkey: u64) -> Result<Effects, Status> {
        s.release(host, Cdw10 { action, iekey, rtype, cptpl: 0 }, crkey)
    }

    /// A, B and C registered; A holds a reservation of type `t`.
    fn held(t: Rtype) -> Reservations {
        let mut s = Reservations::default();
        for (h, k) in [(A, KA), (B, KB), (C, KC)] {
            reg(&mut s, &h, rrega::REGISTER, false, 0, (0, k), false).unwrap();
        }
        acq(&mut s, &A, racqa::ACQUIRE, t as u8, false, (KA, 0)).unwrap();
        s
    }

    #[test]
    fn access_by_type_and_role() {
        // (type, holder read/write, registrant read/write, other read/write): the
        // specification's table "Command Behavior in the Presence of a Reservation".
        let table = [
            (WriteExclusive, (true, true), (true, false), (true, false)),
            (ExclusiveAccess, (true, true), (false, false), (false, false)),
            (WriteExclusiveRegistrantsOnly, (true, true), (true, true), (true, false)),
            (ExclusiveAccessRegistrantsOnly, (true, true), (true, true), (false, false)),
            (WriteExclusiveAllRegistrants, (true, true), (true, true), (true, false)),
            (ExclusiveAccessAllRegistrants, (true, true), (true, true), (false, false)),
        ];
        for (t, holder, registrant, other) in table {
            // C unregisters: it is the "other" host; B stays a registrant.
            let mut s = held(t);
            reg(&mut s, &C, rrega::UNREGISTER, false, 0, (KC, 0), false).unwrap();
            for (who, (r, w)) in [(A, holder), (B, registrant), (C, other)] {
                assert_eq!(s.allows(&who, Access::Read), r, "{t:?} read by {who:?}");
                assert_eq!(s.allows(&who, Access::Write), w, "{t:?} write by {who:?}");
            }
        }
        let free = Reservations::default();
        assert!(free.allows(&C, Access::Write) && free.allows(&C, Access::Read));
    }

    fn status(r: Result<Effects, Status>) -> Status {
        r.err().unwrap_or(Status::SUCCESS)
    }

    #[test]
    fn register_cases() {
        // (before: registered key of A, action, iekey, cptpl, crkey, nrkey, expected status, key after)
        let table: &[RegisterCase] = &[
            (None, rrega::REGISTER, false, 0, 0, KA, Status::SUCCESS, Some(KA)),
            (Some(KA), rrega::REGISTER, false, 0, 0, KA, Status::SUCCESS, Some(KA)),
            (Some(KA), rrega::REGISTER, false, 0, 0, KB, conflict(), Some(KA)),
            (Some(KA), rrega::UNREGISTER, false, 0, KA, 0, Status::SUCCESS, None),
            (Some(KA), rrega::UNREGISTER, false, 0, KB, 0, conflict(), Some(KA)),
            (Some(KA), rrega::UNREGISTER, true, 0, KB, 0, Status::SUCCESS, None),
            (None, rrega::UNREGISTER, true, 0, 0, 0, conflict(), None),
            (Some(KA), rrega::REPLACE, false, 0, KA, KB, Status::SUCCESS, Some(KB)),
            (Some(KA), rrega::REPLACE, false, 0, KC, KB, conflict(), Some(KA)),
            (Some(KA), rrega::REPLACE, true, 0, KC, KB, Status::SUCCESS, Some(KB)),
            (None, rrega::REPLACE, false, 0, 0, KB, conflict(), None),
            (None, rrega::REPLACE, true, 0, 0, KB, Status::SUCCESS, Some(KB)),
            (None, 3, false, 0, 0, KA, invalid(), None),
            (None, rrega::REGISTER, false, 1, 0, KA, invalid(), None),
            // PTPL on a namespace with nowhere to persist.
            (None, rrega::REGISTER, false, cptpl::SET, 0, KA, invalid(), None),
        ];
        for (i, &(before, action, iekey, cp, crkey, nrkey, want, after)) in table.iter().enumerate() {
            let mut s = Reservations::default();
            if let Some(k) = before {
                reg(&mut s, &A, rrega::REGISTER, false, 0, (0, k), false).unwrap();
            }
            let gen = s.generation;
            let got = status(reg(&mut s, &A, action, iekey, cp, (crkey, nrkey), false));
            assert_eq!(got, want, "case {i}");
            assert_eq!(s.key_of(&A), after, "case {i}");
            assert_eq!(s.generation, if want.is_success() { gen + 1 } else { gen }, "case {i}: generation");
        }
        let mut s = Reservations::default();
        // CPTPL: set, then cleared, where the namespace can persist.
        reg(&mut s, &A, rrega::REGISTER, false, cptpl::SET, (0, KA), true).unwrap();
        assert!(s.ptpl);
        reg(&mut s, &A, rrega::REGISTER, false, cptpl::CLEAR, (0, KA), true).unwrap();
        assert!(!s.ptpl);
        // The registrant limit.
        let mut s = Reservations::default();
        for i in 0..MAX as u8 {
            reg(&mut s, &[i + 1; 16], rrega::REGISTER, false, 0, (0, 1), false).unwrap();
        }
        assert_eq!(status(reg(&mut s, &[0xff; 16], rrega::REGISTER, false, 0, (0, 1), false)), Status::INTERNAL_ERROR.dnr());
    }

    #[test]
    fn unregistering_the_holder() {
        // (type, reservation left, notices to B and C)
        for (t, left, notified) in [
            (WriteExclusive, None, false),
            (ExclusiveAccess, None, false),
            (WriteExclusiveRegistrantsOnly, None, true),
            (ExclusiveAccessRegistrantsOnly, None, true),
            (WriteExclusiveAllRegistrants, Some(WriteExclusiveAllRegistrants), false),
            (ExclusiveAccessAllRegistrants, Some(ExclusiveAccessAllRegistrants), false),
        ] {
            let mut s = held(t);
            let fx = reg(&mut s, &A, rrega::UNREGISTER, false, 0, (KA, 0), false).unwrap();
            assert_eq!(s.rtype, left, "{t:?}");
            let want: Vec<_> =
                if notified { [B, C].map(|host| Notice { host, kind: notice::RESERVATION_RELEASED }).to_vec() } else { vec![] };
            assert_eq!(fx.notices, want, "{t:?}");
        }
        // The last registrant of an All Registrants reservation takes it with it.
        let mut s = held(WriteExclusiveAllRegistrants);
        for (h, k) in [(A, KA), (B, KB), (C, KC)] {
            reg(&mut s, &h, rrega::UNREGISTER, false, 0, (k, 0), false).unwrap();
        }
        assert_eq!(s.rtype, None);
    }

    #[test]
    fn acquire_cases() {
        // (issuer, its key, action, type, prkey, status, type after, holder after)
        let table: &[AcquireCase] = &[
            // A holds Write Exclusive already: the same type again is fine, another is not.
            (A, KA, racqa::ACQUIRE, WriteExclusive, 0, Status::SUCCESS, Some(WriteExclusive), Some(A)),
            (A, KA, racqa::ACQUIRE, ExclusiveAccess, 0, conflict(), Some(WriteExclusive), Some(A)),
            (B, KB, racqa::ACQUIRE, WriteExclusive, 0, conflict(), Some(WriteExclusive), Some(A)),
            // A wrong current key, or no registration.
            (B, KC, racqa::ACQUIRE, WriteExclusive, 0, conflict(), Some(WriteExclusive), Some(A)),
            ([0xd; 16], 0, racqa::PREEMPT, WriteExclusive, KA, conflict(), Some(WriteExclusive), Some(A)),
            // B preempts A (by A's key): B holds, A is unregistered.
            (B, KB, racqa::PREEMPT, ExclusiveAccess, KA, Status::SUCCESS, Some(ExclusiveAccess), Some(B)),
            (B, KB, racqa::PREEMPT_AND_ABORT, WriteExclusive, KA, Status::SUCCESS, Some(WriteExclusive), Some(B)),
            // B preempts C (not the holder): C goes, A still holds.
            (B, KB, racqa::PREEMPT, WriteExclusive, KC, Status::SUCCESS, Some(WriteExclusive), Some(A)),
            // No registrant has the key; PRKEY 0 while the holder's key is not 0.
            (B, KB, racqa::PREEMPT, WriteExclusive, 0x1234, conflict(), Some(WriteExclusive), Some(A)),
            (B, KB, racqa::PREEMPT, WriteExclusive, 0, invalid(), Some(WriteExclusive), Some(A)),
            // The holder changes the type by preempting itself.
            (A, KA, racqa::PREEMPT, ExclusiveAccess, KA, Status::SUCCESS, Some(ExclusiveAccess), Some(A)),
        ];
        for (i, &(who, key, action, t, prkey, want, t_after, h_after)) in table.iter().enumerate() {
            let mut s = held(WriteExclusive);
            assert_eq!(status(acq(&mut s, &who, action, t as u8, false, (key, prkey))), want, "case {i}");
            assert_eq!((s.rtype, s.holder), (t_after, h_after), "case {i}");
        }
        let mut s = held(WriteExclusive);
        for (rtype, iekey, action) in [(0u8, false, 0u8), (7, false, 0), (1, true, 0), (1, false, 3)] {
            assert_eq!(status(acq(&mut s, &B, action, rtype, iekey, (KB, 0))), invalid(), "rtype {rtype} iekey {iekey} action {action}");
        }
    }

    #[test]
    fn preempt_notices_and_generation() {
        let mut s = held(WriteExclusive);
        let gen = s.generation;
        let fx = acq(&mut s, &B, racqa::PREEMPT, ExclusiveAccess as u8, false, (KB, KA)).unwrap();
        assert_eq!(s.generation, gen + 1);
        assert_eq!(s.key_of(&A), None);
        assert_eq!(fx.preempted, vec![A]);
        // A learns its registration went; C that the Write Exclusive reservation is gone.
        assert_eq!(
            fx.notices,
            vec![Notice { host: A, kind: notice::REGISTRATION_PREEMPTED }, Notice { host: C, kind: notice::RESERVATION_RELEASED }]
        );
        // All Registrants, PRKEY 0: every other registrant goes, B holds the new type.
        let mut s = held(WriteExclusiveAllRegistrants);
        let fx = acq(&mut s, &B, racqa::PREEMPT_AND_ABORT, WriteExclusive as u8, false, (KB, 0)).unwrap();
        assert_eq!((s.rtype, s.holder, s.registrants.len()), (Some(WriteExclusive), Some(B), 1));
        assert_eq!(fx.preempted, vec![A, C]);
        assert_eq!(
            fx.notices.iter().map(|n| (n.host, n.kind)).collect::<Vec<_>>(),
            vec![(A, notice::REGISTRATION_PREEMPTED), (C, notice::REGISTRATION_PREEMPTED)]
        );
        // All Registrants, a key: only that registrant goes; the reservation stays.
        let mut s = held(ExclusiveAccessAllRegistrants);
        let fx = acq(&mut s, &B, racqa::PREEMPT, WriteExclusive as u8, false, (KB, KC)).unwrap();
        assert_eq!((s.rtype, s.key_of(&C), fx.preempted), (Some(ExclusiveAccessAllRegistrants), None, vec![C]));
        // The issuer is never among the preempted: not when it preempts itself to change
        // the type, nor when it unregisters itself by its own key.
        let mut s = held(WriteExclusive);
        let fx = acq(&mut s, &A, racqa::PREEMPT_AND_ABORT, ExclusiveAccess as u8, false, (KA, KA)).unwrap();
        assert_eq!((s.rtype, fx.preempted), (Some(ExclusiveAccess), vec![]));
        let mut s = held(WriteExclusiveAllRegistrants);
        reg(&mut s, &C, rrega::REPLACE, false, 0, (KC, KB), false).unwrap();
        let fx = acq(&mut s, &B, racqa::PREEMPT_AND_ABORT, WriteExclusive as u8, false, (KB, KB)).unwrap();
        assert_eq!((s.key_of(&B), s.key_of(&C), fx.preempted), (None, None, vec![C]));
        // No reservation: preempt only unregisters.
        let mut s = held(WriteExclusive);
        rel(&mut s, &A, rrela::RELEASE, WriteExclusive as u8, false, KA).unwrap();
        acq(&mut s, &B, racqa::PREEMPT, WriteExclusive as u8, false, (KB, KC)).unwrap();
        assert_eq!((s.rtype, s.key_of(&C)), (None, None));
    }

    #[test]
    fn release_cases() {
        // (type held by A, issuer, its key, action, rtype, status, type after, notices)
        let table: &[ReleaseCase] = &[
            (WriteExclusive, A, KA, rrela::RELEASE, 1, Status::SUCCESS, None, &[]),
            (
                WriteExclusiveRegistrantsOnly,
                A,
                KA,
                rrela::RELEASE,
                3,
                Status::SUCCESS,
                None,
                &[(B, notice::RESERVATION_RELEASED), (C, notice::RESERVATION_RELEASED)],
            ),
            // A type that is not the reservation's.
            (WriteExclusive, A, KA, rrela::RELEASE, 2, invalid(), Some(WriteExclusive), &[]),
            // Not the holder: nothing happens, successfully.
            (WriteExclusive, B, KB, rrela::RELEASE, 1, Status::SUCCESS, Some(WriteExclusive), &[]),
            // Any registrant releases an All Registrants reservation.
            (
                ExclusiveAccessAllRegistrants,
                B,
                KB,
                rrela::RELEASE,
                6,
                Status::SUCCESS,
                None,
                &[(A, notice::RESERVATION_RELEASED), (C, notice::RESERVATION_RELEASED)],
            ),
            (WriteExclusive, B, KA, rrela::RELEASE, 1, conflict(), Some(WriteExclusive), &[]),
            (WriteExclusive, A, KA, 2, 1, invalid(), Some(WriteExclusive), &[]),
            (
                WriteExclusive,
                B,
                KB,
                rrela::CLEAR,
                0,
                Status::SUCCESS,
                None,
                &[(A, notice::RESERVATION_PREEMPTED), (C, notice::RESERVATION_PREEMPTED)],
            ),
        ];
        for (i, &(held_type, who, key, action, rtype, want, after, notices)) in table.iter().enumerate() {
            let mut s = held(held_type);
            let r = rel(&mut s, &who, action, rtype, false, key);
            let fx = r.as_ref().map(|f| f.notices.iter().map(|n| (n.host, n.kind)).collect::<Vec<_>>()).unwrap_or_default();
            assert_eq!(status(r), want, "case {i}");
            assert_eq!(s.rtype, after, "case {i}");
            assert_eq!(fx, notices, "case {i}");
            if action == rrela::CLEAR {
                assert!(s.registrants.is_empty(), "case {i}");
            }
        }
        let mut s = held(WriteExclusive);
        assert_eq!(status(rel(&mut s, &A, rrela::RELEASE, 1, true, KA)), invalid());
    }

    #[test]
    fn report_marks_holders() {
        let s = held(WriteExclusive);
        let r = s.report();
        assert_eq!((r.rtype, r.regctl), (1, 3));
        assert_eq!(r.registrants.iter().map(|r| r.holder).collect::<Vec<_>>(), vec![true, false, false]);
        let r = held(WriteExclusiveAllRegistrants).report();
        assert!(r.registrants.iter().all(|r| r.holder));
    }

    #[test]
    fn state_file_round_trip_and_damage() {
        for t in Rtype::ALL {
            let mut s = held(t);
            s.ptpl = true;
            let b = s.encode_file();
            assert_eq!(Reservations::decode_file(&b, MAX), Ok(s.clone()), "{t:?}");
            for i in 0..b.len() {
                let mut bad = b.clone();
                bad[i] ^= 0x40;
                assert!(Reservations::decode_file(&bad, MAX).is_err(), "{t:?}: flipped byte {i}");
            }
            for n in 0..b.len() {
                assert!(Reservations::decode_file(&b[..n], MAX).is_err(), "{t:?}: {n} bytes");
            }
        }
        assert_eq!(Reservations::decode_file(&Reservations::default().encode_file(), MAX), Ok(Reservations::default()));
    }
}
