//! `copy`: the input object's bytes into the output object, as they are. The target does
//! it without the bytes crossing the network.

use crate::{no_args, ComputeError, Context, Outcome, Sink, Source, Transform};

struct Copy;

impl Transform for Copy {
    fn run(self: Box<Self>, inputs: &mut [&mut dyn Source], outputs: &mut [&mut dyn Sink], _: &Context) -> Result<Outcome, ComputeError> {
        let (src, out) = (&mut *inputs[0], &mut *outputs[0]);
        let mut n = 0;
        while let Some(c) = src.next_chunk()? {
            out.write(c)?;
            n += c.len() as u64;
        }
        Ok(Outcome::Written { input: n, output: out.written() })
    }
}

pub fn build(args: &[u8]) -> Result<Box<dyn Transform>, ComputeError> {
    no_args("copy", args)?;
    Ok(Box::new(Copy))
}

#[cfg(test)]
mod tests {
    use crate::{by_name, ComputeError, Context, Outcome, SliceSource, VecSink};

    #[test]
    fn copies_and_refuses_a_small_output() {
        let op = by_name("copy").unwrap();
        let mut src = SliceSource::new([&b"hello "[..], b"world"]);
        let mut out = VecSink::new(11);
        let r = op.execute(b"", &mut [&mut src], &mut [&mut out], &Context::default()).unwrap();
        assert_eq!(r, vec![Outcome::Written { input: 11, output: 11 }]);
        assert_eq!(out.data, b"hello world");

        let mut src = SliceSource::new([&b"hello world"[..]]);
        let mut out = VecSink::new(5);
        let e = op.execute(b"", &mut [&mut src], &mut [&mut out], &Context::default()).unwrap_err();
        assert_eq!(e, ComputeError::OutputFull { capacity: 5 });

        let mut src = SliceSource::new([&b"x"[..]]);
        let e = op.execute(b"", &mut [&mut src], &mut [], &Context::default()).unwrap_err();
        assert_eq!(e.to_string(), "copy takes 1 output objects, not 0");
    }
}
