//! What a shard changed: the format of a shard's result.
//!
//! Every shard runs against its task's writable buffers as the unsharded run would
//! see them (an `--inout` file, or zeros, or a reduction's identity). What it
//! returns is only the words it changed: runs of consecutive changed 4-byte words,
//! each with its offset. So the bytes a shard stores and sends scale with what it
//! wrote, not with the size of the buffers, and a merge can tell which shard wrote
//! which word (see `gpumesh_shaders::merge`).
//!
//! The encoding is a plain binary layout rather than bincode, so a result of any size
//! the blob limit allows decodes without the codec's message cap, and equal changes
//! always encode to equal bytes (replicas compare results by hash):
//!
//! ```text
//! "GMC1"
//! varint  buffers
//! per buffer, in binding order:
//!   varint binding, varint buffer size in bytes, varint runs,
//!   per run: varint unchanged words since the previous run's end, varint words,
//!   the runs' bytes, concatenated
//! ```

use std::collections::BTreeMap;

use crate::error::{ProtocolError, Result};

const MAGIC: &[u8; 4] = b"GMC1";

/// What one writable buffer's words started as, for a diff.
#[derive(Clone, Copy, Debug)]
pub enum Base<'a> {
    /// The bytes of an `--inout` file.
    Bytes(&'a [u8]),
    /// Every word the same: zeros, or a reduction's identity element.
    Fill([u8; 4]),
}

impl Base<'_> {
    /// The whole buffer of `size` bytes (a multiple of 4).
    pub fn materialise(&self, size: usize) -> Vec<u8> {
        match self {
            Base::Bytes(b) => b[..size].to_vec(),
            Base::Fill([0, 0, 0, 0]) => vec![0; size],
            Base::Fill(word) => word.repeat(size / 4),
        }
    }
}

/// A run of consecutive changed words of one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Byte offset of the first changed word (a multiple of 4).
    pub offset: u64,
    /// Bytes in the run (a multiple of 4, never 0).
    pub len: u64,
}

impl Run {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// The words of one buffer of `size` bytes that a shard changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BufferChanges {
    pub size: u64,
    /// Ascending, non-overlapping and never adjacent (adjacent runs are one run).
    runs: Vec<Run>,
    /// The runs' new bytes, in run order.
    data: Vec<u8>,
}

impl BufferChanges {
    /// The words of `after` that differ from `before`. Both are `after.len()` bytes,
    /// a multiple of 4 (every gpumesh buffer is).
    pub fn diff(before: Base<'_>, after: &[u8]) -> Self {
        let size = after.len();
        let mut runs = Vec::new();
        let mut data = Vec::new();
        let mut open: Option<usize> = None;
        // Compare in blocks first: unchanged stretches are skipped with memcmp-speed
        // slice comparisons, and only differing blocks are walked word by word.
        const BLOCK: usize = 256;
        let mut fill = [0u8; BLOCK];
        if let Base::Fill(word) = before {
            for c in fill.chunks_exact_mut(4) {
                c.copy_from_slice(&word);
            }
        }
        let mut at = 0;
        while at < size {
            let end = (at + BLOCK).min(size);
            let old = match before {
                Base::Bytes(b) => &b[at..end],
                Base::Fill(_) => &fill[..end - at],
            };
            let new = &after[at..end];
            if open.is_some() && all_differ(old, new) {
                at = end; // the open run goes on through this block
                continue;
            }
            if old == new {
                if let Some(start) = open.take() {
                    runs.push(Run {
                        offset: start as u64,
                        len: (at - start) as u64,
                    });
                    data.extend_from_slice(&after[start..at]);
                }
                at = end;
                continue;
            }
            let words = old.chunks_exact(4).zip(new.chunks_exact(4));
            for (k, (o, n)) in words.enumerate() {
                let w = at + 4 * k;
                let changed = u32::from_ne_bytes([o[0], o[1], o[2], o[3]])
                    != u32::from_ne_bytes([n[0], n[1], n[2], n[3]]);
                match (changed, open) {
                    (true, None) => open = Some(w),
                    (false, Some(start)) => {
                        runs.push(Run {
                            offset: start as u64,
                            len: (w - start) as u64,
                        });
                        data.extend_from_slice(&after[start..w]);
                        open = None;
                    }
                    _ => {}
                }
            }
            at = end;
        }
        if let Some(start) = open {
            runs.push(Run {
                offset: start as u64,
                len: (size - start) as u64,
            });
            data.extend_from_slice(&after[start..size]);
        }
        BufferChanges {
            size: size as u64,
            runs,
            data,
        }
    }

    /// Every word of a buffer, as if all of them changed.
    pub fn whole(bytes: &[u8]) -> Self {
        let runs = if bytes.is_empty() {
            Vec::new()
        } else {
            vec![Run {
                offset: 0,
                len: bytes.len() as u64,
            }]
        };
        BufferChanges {
            size: bytes.len() as u64,
            runs,
            data: bytes.to_vec(),
        }
    }

    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// The buffer's bytes when every word is in these changes (as
    /// [`Self::whole`] makes them), without a copy; `None` otherwise.
    pub fn into_whole(self) -> Option<Vec<u8>> {
        self.is_whole().then_some(self.data)
    }

    /// [`Self::into_whole`], borrowed.
    pub fn as_whole(&self) -> Option<&[u8]> {
        self.is_whole().then_some(&self.data[..])
    }

    fn is_whole(&self) -> bool {
        match self.runs[..] {
            [] => self.size == 0,
            [only] => only.offset == 0 && only.len == self.size,
            _ => false,
        }
    }

    /// Each run with its new bytes.
    pub fn iter(&self) -> impl Iterator<Item = (Run, &[u8])> + '_ {
        let mut at = 0usize;
        self.runs.iter().map(move |r| {
            let bytes = &self.data[at..at + r.len as usize];
            at += r.len as usize;
            (*r, bytes)
        })
    }

    /// The changed words' new bytes, in run order (fault injection corrupts them).
    pub fn values_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }

    /// Bytes of changed words.
    pub fn changed_bytes(&self) -> u64 {
        self.data.len() as u64
    }

    /// Writes the changed words into `buffer` (of [`Self::size`] bytes).
    pub fn apply_to(&self, buffer: &mut [u8]) {
        for (run, bytes) in self.iter() {
            buffer[run.offset as usize..run.end() as usize].copy_from_slice(bytes);
        }
    }

    /// The buffer after the changes: `before` with the changed words written.
    pub fn applied(&self, before: Base<'_>) -> Vec<u8> {
        let mut out = before.materialise(self.size as usize);
        self.apply_to(&mut out);
        out
    }
}

/// Whether every 4-byte word of `old` differs from `new`'s at the same place: a
/// block of a densely written buffer, which then needs no walk word by word. No
/// early exit, so the comparison can run as vector instructions.
fn all_differ(old: &[u8], new: &[u8]) -> bool {
    old.chunks_exact(4)
        .zip(new.chunks_exact(4))
        .fold(true, |all, (o, n)| {
            all & (u32::from_ne_bytes([o[0], o[1], o[2], o[3]])
                != u32::from_ne_bytes([n[0], n[1], n[2], n[3]]))
        })
}

/// What one shard changed, by binding number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardChanges(pub BTreeMap<u32, BufferChanges>);

impl ShardChanges {
    /// Bytes of changed words over all buffers.
    pub fn changed_bytes(&self) -> u64 {
        self.0.values().map(BufferChanges::changed_bytes).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.changed_bytes() as usize);
        out.extend_from_slice(MAGIC);
        put(&mut out, self.0.len() as u64);
        for (&binding, b) in &self.0 {
            put(&mut out, u64::from(binding));
            put(&mut out, b.size);
            put(&mut out, b.runs.len() as u64);
            let mut prev = 0;
            for r in &b.runs {
                put(&mut out, (r.offset - prev) / 4);
                put(&mut out, r.len / 4);
                prev = r.end();
            }
            out.extend_from_slice(&b.data);
        }
        out
    }

    /// Decodes and checks [`Self::encode`]'s layout: runs inside their buffer, in
    /// order, not touching, and exactly as many bytes as they claim.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |reason: &str| ProtocolError::Invalid {
            what: "shard result",
            reason: reason.to_string(),
        };
        let mut r = Reader { bytes, at: 0 };
        if r.take(4).ok_or_else(|| bad("too short"))? != MAGIC {
            return Err(bad("not a gpumesh shard result (bad magic)"));
        }
        let buffers = r.varint().ok_or_else(|| bad("truncated buffer count"))?;
        let mut out = BTreeMap::new();
        let mut last_binding = None;
        for _ in 0..buffers {
            let binding = r.varint().ok_or_else(|| bad("truncated binding"))?;
            let binding = u32::try_from(binding).map_err(|_| bad("binding out of range"))?;
            if last_binding.is_some_and(|l| l >= binding) {
                return Err(bad("bindings out of order"));
            }
            last_binding = Some(binding);
            let size = r.varint().ok_or_else(|| bad("truncated size"))?;
            let count = r.varint().ok_or_else(|| bad("truncated run count"))?;
            // Each run takes at least two bytes of the input: a hostile count cannot
            // make this allocate more than the input's size.
            if count > (bytes.len() as u64) / 2 {
                return Err(bad("more runs than the result has bytes"));
            }
            let mut runs = Vec::with_capacity(count as usize);
            let mut prev = 0u64;
            let mut total = 0u64;
            for i in 0..count {
                let gap = r.varint().ok_or_else(|| bad("truncated run"))?;
                let words = r.varint().ok_or_else(|| bad("truncated run"))?;
                if words == 0 || (gap == 0 && i > 0) {
                    return Err(bad("empty or touching runs"));
                }
                let offset = gap
                    .checked_mul(4)
                    .and_then(|g| prev.checked_add(g))
                    .ok_or_else(|| bad("run offset overflows"))?;
                let len = words.checked_mul(4).ok_or_else(|| bad("run overflows"))?;
                let end = offset
                    .checked_add(len)
                    .filter(|&e| e <= size)
                    .ok_or_else(|| bad("a run ends past its buffer"))?;
                runs.push(Run { offset, len });
                prev = end;
                total += len;
            }
            let data = r
                .take(usize::try_from(total).map_err(|_| bad("runs too long"))?)
                .ok_or_else(|| bad("runs hold fewer bytes than they claim"))?
                .to_vec();
            out.insert(binding, BufferChanges { size, runs, data });
        }
        if r.at != bytes.len() {
            return Err(ProtocolError::TrailingBytes(bytes.len() - r.at));
        }
        Ok(ShardChanges(out))
    }

    /// Whether two results of the same shard agree: equal bit for bit (`tolerance`
    /// `None`), or as f32 values within the relative `tolerance`. Results with the
    /// same changed words compare those; otherwise each buffer is compared whole,
    /// starting from `bases` (binding → starting contents), so a float that came out
    /// exactly at its starting value on one adapter and a hair off it on another
    /// still agrees. A buffer missing from `bases` compares by its changes alone.
    pub fn agrees(
        &self,
        other: &ShardChanges,
        tolerance: Option<f32>,
        bases: &BTreeMap<u32, Base<'_>>,
    ) -> bool {
        self.0.len() == other.0.len()
            && self.0.iter().zip(&other.0).all(|((ka, a), (kb, b))| {
                if ka != kb || a.size != b.size {
                    return false;
                }
                if a.runs == b.runs {
                    return crate::task::values_agree(&a.data, &b.data, tolerance);
                }
                match (tolerance, bases.get(ka)) {
                    (Some(_), Some(base)) => {
                        crate::task::values_agree(&a.applied(*base), &b.applied(*base), tolerance)
                    }
                    // Bit for bit, different changed words are different buffers.
                    _ => false,
                }
            })
    }
}

fn put(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(s)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self.bytes.get(self.at)?;
            self.at += 1;
            v |= u64::from(b & 0x7f).checked_shl(shift)?;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn words(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn diff_finds_exactly_the_changed_words() {
        let before = words(&[1, 2, 3, 4, 5, 6]);
        let after = words(&[1, 9, 9, 4, 5, 7]);
        let c = BufferChanges::diff(Base::Bytes(&before), &after);
        assert_eq!(
            c.runs(),
            &[Run { offset: 4, len: 8 }, Run { offset: 20, len: 4 }]
        );
        assert_eq!(c.changed_bytes(), 12);
        assert_eq!(c.applied(Base::Bytes(&before)), after);
    }

    #[test]
    fn diff_against_a_fill_and_across_blocks() {
        let mut after = vec![0u8; 4096];
        after[252..260].copy_from_slice(&[1; 8]); // straddles the 256-byte block edge
        after[4092..].copy_from_slice(&[7; 4]);
        let c = BufferChanges::diff(Base::Fill([0; 4]), &after);
        assert_eq!(
            c.runs(),
            &[
                Run {
                    offset: 252,
                    len: 8
                },
                Run {
                    offset: 4092,
                    len: 4
                }
            ]
        );
        let ones = BufferChanges::diff(Base::Fill([1, 0, 0, 0]), &words(&[1, 1, 2]));
        assert_eq!(ones.runs(), &[Run { offset: 8, len: 4 }]);
    }

    /// Runs found word by word, the plain way: the reference for [`diff`].
    fn runs_word_by_word(before: &[u8], after: &[u8]) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        for (k, (o, n)) in before
            .chunks_exact(4)
            .zip(after.chunks_exact(4))
            .enumerate()
        {
            if o == n {
                continue;
            }
            let w = 4 * k as u64;
            match runs.last_mut() {
                Some(r) if r.end() == w => r.len += 4,
                _ => runs.push(Run { offset: w, len: 4 }),
            }
        }
        runs
    }

    #[test]
    fn diff_matches_a_word_by_word_walk_over_dense_sparse_and_ragged_buffers() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..200 {
            // Up to 40 blocks, not always whole ones.
            let words = 1 + (next() % 2600) as usize;
            let before: Vec<u8> = (0..words * 4).map(|_| next() as u8).collect();
            let mut after = before.clone();
            // Stretches changed in full (often whole blocks and more), and single words.
            for _ in 0..(next() % 6) {
                let start = (next() as usize) % words;
                let len = 1 + (next() as usize) % (words - start).min(200);
                for w in start..start + len {
                    after[4 * w] ^= 1 + (next() % 255) as u8;
                }
            }
            for _ in 0..(next() % 8) {
                let w = (next() as usize) % words;
                after[4 * w + 3] ^= 0x80;
            }
            if case % 10 == 0 {
                after.iter_mut().for_each(|b| *b = !*b);
            }
            let c = BufferChanges::diff(Base::Bytes(&before), &after);
            assert_eq!(
                c.runs(),
                &runs_word_by_word(&before, &after)[..],
                "case {case}"
            );
            assert_eq!(c.applied(Base::Bytes(&before)), after, "case {case}");
        }
    }

    #[test]
    fn whole_changes_give_their_bytes_back_and_others_do_not() {
        let bytes = words(&[4, 5, 6]);
        assert_eq!(
            BufferChanges::whole(&bytes).into_whole(),
            Some(bytes.clone())
        );
        assert_eq!(BufferChanges::whole(&[]).into_whole(), Some(Vec::new()));
        let before = words(&[4, 0, 6]);
        let some = BufferChanges::diff(Base::Bytes(&before), &bytes);
        assert_eq!(some.as_whole(), None, "one word of three changed");
        assert_eq!(some.into_whole(), None, "one word of three changed");
        // Every word changed: the diff is one run, its bytes the buffer's.
        let all = BufferChanges::diff(Base::Fill([0; 4]), &bytes);
        assert_eq!(all.as_whole(), Some(&bytes[..]));
    }

    #[test]
    fn unchanged_buffers_have_no_runs_and_encode_small() {
        let b = vec![5u8; 1 << 20];
        let c = BufferChanges::diff(Base::Bytes(&b), &b);
        assert!(c.runs().is_empty());
        let s = ShardChanges(BTreeMap::from([(3, c)]));
        assert!(s.encode().len() < 16);
        assert_eq!(ShardChanges::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn encode_round_trips_and_is_deterministic() {
        let before = words(&(0..1000).collect::<Vec<_>>());
        let mut after = before.clone();
        for i in (0..1000).step_by(7) {
            after[i * 4] ^= 0xff;
        }
        let s = ShardChanges(BTreeMap::from([
            (0, BufferChanges::diff(Base::Bytes(&before), &after)),
            (2, BufferChanges::whole(&after[..64])),
        ]));
        let bytes = s.encode();
        assert_eq!(bytes, s.clone().encode());
        assert_eq!(ShardChanges::decode(&bytes).unwrap(), s);
    }

    #[test]
    fn decode_refuses_malformed_results() {
        let s = ShardChanges(BTreeMap::from([(
            1,
            BufferChanges::diff(Base::Fill([0; 4]), &words(&[0, 5, 0, 6])),
        )]));
        let good = s.encode();
        assert!(ShardChanges::decode(&good[..good.len() - 1]).is_err());
        assert!(ShardChanges::decode(&[good.clone(), vec![0]].concat()).is_err());
        assert!(ShardChanges::decode(b"XXXX\x00").is_err());
        // A run past the end of its buffer: size 16, one run at word 3 of 2 words.
        let mut past = MAGIC.to_vec();
        past.extend_from_slice(&[1, 1, 16, 1, 3, 2]);
        past.extend_from_slice(&[0; 8]);
        assert!(ShardChanges::decode(&past).is_err());
        // A count of runs far beyond the input.
        let mut many = MAGIC.to_vec();
        many.extend_from_slice(&[1, 1, 16, 0xff, 0xff, 0xff, 0x0f]);
        assert!(ShardChanges::decode(&many).is_err());
    }

    #[test]
    fn agreement_is_bitwise_or_within_tolerance() {
        let a = ShardChanges(BTreeMap::from([(
            0,
            BufferChanges::whole(&1.0f32.to_le_bytes()),
        )]));
        let b = ShardChanges(BTreeMap::from([(
            0,
            BufferChanges::whole(&1.000_001f32.to_le_bytes()),
        )]));
        let none = BTreeMap::new();
        assert!(a.agrees(&a, None, &none));
        assert!(!a.agrees(&b, None, &none));
        assert!(a.agrees(&b, Some(1e-5), &none));
        assert!(!a.agrees(&ShardChanges::default(), Some(1e-5), &none));
    }

    #[test]
    fn floats_at_their_start_on_one_side_agree_within_tolerance() {
        // One replica left word 1 at its start (0.0), the other wrote 1e-38 there.
        let start = [0u8; 8];
        let x: Vec<u8> = [1.0f32, 0.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let y: Vec<u8> = [1.0f32, 1e-38]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let a = ShardChanges(BTreeMap::from([(
            0,
            BufferChanges::diff(Base::Bytes(&start), &x),
        )]));
        let b = ShardChanges(BTreeMap::from([(
            0,
            BufferChanges::diff(Base::Bytes(&start), &y),
        )]));
        let bases = BTreeMap::from([(0, Base::Bytes(&start))]);
        assert!(a.agrees(&b, Some(1e-5), &bases));
        assert!(!a.agrees(&b, None, &bases));
        let z: Vec<u8> = [1.0f32, 0.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let c = ShardChanges(BTreeMap::from([(
            0,
            BufferChanges::diff(Base::Bytes(&start), &z),
        )]));
        assert!(!a.agrees(&c, Some(1e-5), &bases));
    }
}
